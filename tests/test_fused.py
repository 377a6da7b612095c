"""The fused per-row summaries over a wide vocabulary equal their eager definitions: argmax's first-index rule on
exact ties at the top, the second largest under ties, pruned (-inf) logits, and inside a larger compiled graph."""

from __future__ import annotations

import pytest
import torch

from emad.engine.entropy import readout_summary
from emad.engine.fused import MIN_WIDTH, readout_scores, readout_scores_top2, summary
from emad.exits.criteria import fused_top2_gap

V = 49152  # SmolLM2's vocabulary: the fused kernels run (MIN_WIDTH)


@pytest.fixture(scope="module")
def rows():
    """``[r, V]`` logits with exact ties at the top (the target first, second or outside them), a pruned row, a flat
    row, and ``[r]`` targets."""
    assert V >= MIN_WIDTH
    torch.manual_seed(0)
    logits = torch.randn(24, V) * 4
    targets = torch.randint(0, V, (24,))
    for row, (a, b) in enumerate([(10, 20), (10, 20), (10, 20), (5, V - 1)]):
        logits[row, [a, b]] = logits[row].max() + 1  # a tie at the top
    targets[0], targets[1], targets[2], targets[3] = 10, 20, 7, 5  # first tied, second tied, neither, first
    logits[4, 50:] = float("-inf")  # pruned: 50 tokens left
    logits[5] = 0.5  # flat: every index tied
    targets[5] = 3
    logits[6, 1:] = float("-inf")  # one token left
    targets[6] = 0
    return logits, targets


def test_readout_scores_follow_argmaxs_first_index_on_ties(rows):
    logits, targets = rows
    entropy, max_prob, logprob, greedy = readout_scores(logits, targets)
    assert greedy.tolist() == (logits.argmax(-1) == targets).tolist()
    assert greedy[:3].tolist() == [True, False, False] and greedy[3] and not greedy[5] and greedy[6]
    want_entropy, _, want_max = readout_summary(logits)
    assert torch.allclose(entropy, want_entropy, atol=1e-5) and torch.allclose(max_prob, want_max, atol=1e-6)
    want_logprob = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(logprob, want_logprob, atol=1e-4)
    *same, gap = readout_scores_top2(logits, targets)
    for got, want in zip(same, (entropy, max_prob, logprob, greedy)):
        assert torch.equal(got, want)
    top = torch.softmax(logits, -1).topk(2, -1).values
    assert torch.allclose(gap, top[:, 0] - top[:, 1], atol=1e-6)
    assert gap[:4].tolist() == [0.0] * 4 and gap[5] == 0 and gap[6] == 1
    assert torch.equal(fused_top2_gap(logits), gap)


def test_summary_is_readout_summarys_entropy_and_max_probability(rows):
    logits, _ = rows
    entropy, max_prob = summary(logits)
    want_entropy, _, want_max = readout_summary(logits)
    assert torch.allclose(entropy, want_entropy, atol=1e-5) and torch.allclose(max_prob, want_max, atol=1e-6)


def test_inside_a_compiled_graph_ties_are_settled_without_a_branch(rows):
    """Traced into a caller's graph (a compiled decode step), the first-index rule holds without the host-side fix."""
    logits, targets = rows
    greedy = torch.compile(lambda x, t: readout_scores(x, t)[3], dynamic=True)(logits, targets)
    assert greedy.tolist() == (logits.argmax(-1) == targets).tolist()
