"""Sweep scoring (the monotone equivalence): many methods scored from one full-depth pass equal each method scored
alone — depths identical, log-probabilities to float rounding, FLOPs equal — whatever else shares the pass."""

from __future__ import annotations

import math
import random

import pytest
import torch

from emad.calibration.calibrate import calibrate, windows
from emad.calibration.profile import smooth_variants
from emad.decode import Method, score_continuations
from emad.decode.monotone import Segments
from emad.decode.sweep import Sweep, score_sweep, sweep_refusal
from emad.engine.stack import LayerStack
from emad.exits.criteria import MEMO_BLOCK, Confidence, Contrastive, Emad, Fixed, Full, SoftmaxResponse
from emad.exits.estimators import LowRank, Prune, TopK
from emad.exits.strata import Strata
from emad.methods import STRATEGIES
from tests.test_readouts import random_lens
from tests.tiny import VOCAB, random_prompts, tiny_model


@pytest.fixture(scope="module")
def stack():
    return LayerStack(tiny_model("llama"))


@pytest.fixture(scope="module")
def profiles(stack):
    """A profile per strata variant and readout (the tuned one calibrated through the lens)."""
    out = {}
    for readout, lens in (("logit", None), ("tuned", random_lens())):
        view = stack.with_readout(lens)
        stats = calibrate(view, windows(random_prompts(12, [24], seed=11), 24), [1, 2, 3, 4],
                          Strata(position_edges=(8,), confidence_edges=(0.3,)), batch_size=4)
        for variant, profile in smooth_variants(stats, min_count=5).items():
            out[readout, variant] = profile
    return out


def _estimators():
    shortlist = list(range(0, VOCAB, 2))
    return {
        "exact": lambda: None,
        "topk": lambda: TopK(len(shortlist), shortlist, {1: (1.1, 0.1), 2: (0.9, 0.2)}),
        "lowrank": lambda: LowRank(8, {3: (1.2, -0.1)}),
        "prune": lambda: Prune(12),
        "prune-decay": lambda: Prune(40, "decay", 6),
        "prune-adaptive": lambda: Prune(prune_schedule="adaptive"),
    }


def _family_methods(profiles, readout: str, lens) -> dict[str, Method]:
    """Every per-token criterion along its knob, each with every estimator it pairs with."""
    methods: dict[str, Method] = {"full": Method(Full(), readout=lens)}
    for depth in (1, 2, 3):
        methods[f"fixed-{depth}"] = Method(Fixed(depth), readout=lens)
    for est_name, make in _estimators().items():
        extra = {} if make() is None else {"estimator": make()}
        for h0 in (0.0, 2.0, 3.0, 3.8, 4.2, math.inf):
            if est_name.startswith("prune"):
                continue  # prune serves criteria that read the readout
            methods[f"confidence-{h0}-{est_name}"] = Method(Confidence(h0, probe_every=1),
                                                            readout=lens, **_fresh(extra, make))
        for variant in ("none", "position", "both"):
            for margin in (0.0, 0.25, 0.5, 1.0, math.inf):
                if est_name.startswith("prune"):
                    continue
                crit = Emad(profiles[readout, variant], margin, min_exit_layer=2 if margin == 0.25 else 1)
                methods[f"emad-{variant}-{margin}-{est_name}"] = Method(crit, readout=lens, **_fresh(extra, make))
                if variant != "both":  # every 2nd probe (confidence strata keep their first probe)
                    crit = Emad(profiles[readout, variant], margin, probe_stride=2)
                    methods[f"emad-{variant}-{margin}-{est_name}/2"] = Method(crit, readout=lens,
                                                                              **_fresh(extra, make))
        if est_name in ("exact", "prune", "prune-decay", "prune-adaptive"):
            for gap in (0.0, 0.05, 0.2, 0.5, 2.0):
                methods[f"softmax-{gap}-{est_name}"] = Method(SoftmaxResponse(gap, probe_every=1), readout=lens,
                                                              **_fresh(extra, make))
            for conf in (0.1, 0.3, 0.6):
                methods[f"contrastive-{conf}-{est_name}"] = Method(
                    Contrastive(conf, alpha=0.2, probe_every=1), readout=lens, **_fresh(extra, make))
    return methods


def _fresh(extra: dict, make) -> dict:
    return {} if not extra else {"estimator": make()}


def _cases():
    prompt = random_prompts(1, [9], seed=3)[0]
    continuations = random_prompts(3, [14, 1, 7], seed=4)
    return prompt, continuations


def _assert_same(got, want, name: str) -> None:
    assert got.depths == want.depths, name
    assert got.greedy == want.greedy, name
    assert got.flops == want.flops, name
    assert got.full_flops == want.full_flops, name
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0), name


@pytest.mark.parametrize("readout", ["logit", "tuned"])
def test_every_method_of_a_sweep_equals_its_own_scoring(stack, profiles, readout):
    lens = None if readout == "logit" else random_lens()
    methods = _family_methods(profiles, readout, lens)
    prompt, continuations = _cases()
    together = score_sweep(stack, prompt, continuations, list(methods.values()))
    depths_seen = set()
    for (name, method), got in zip(methods.items(), together):
        alone = score_continuations(stack, prompt, continuations, method)
        for g, a in zip(got, alone):
            _assert_same(g, a, name)
            depths_seen.update(a.depths)
    assert depths_seen == {1, 2, 3, 4}  # the knobs span exits at every probe


def test_sweep_equals_token_by_token_generation_semantics(stack, profiles):
    """The reference of parallel scoring: one decode step per token (the generator's own code path)."""
    methods = {"emad": Method(Emad(profiles["logit", "both"], 0.25)), "conf": Method(Confidence(3.0, probe_every=1)),
               "softmax-prune": Method(SoftmaxResponse(0.05, probe_every=1), estimator=Prune(40, "decay", 6)),
               "contrastive-tuned": Method(Contrastive(0.3, alpha=0.2, probe_every=1), readout=random_lens())}
    prompt, continuations = _cases()
    together = score_sweep(stack, prompt, continuations, list(methods.values()))
    for (name, method), got in zip(methods.items(), together):
        for g, c in zip(got, continuations):
            _assert_same(g, score_continuations(stack, prompt, [c], method, parallel=False)[0], name)


def test_order_and_company_do_not_change_a_result(stack, profiles):
    lens = random_lens()
    methods = list(_family_methods(profiles, "tuned", lens).values())[::7]
    methods += list(_family_methods(profiles, "logit", None).values())[::5]
    prompt, continuations = _cases()
    forward = score_sweep(stack, prompt, continuations, methods)
    order = list(range(len(methods)))
    random.Random(0).shuffle(order)
    shuffled = score_sweep(stack, prompt, continuations, [methods[i] for i in order])
    for pos, i in enumerate(order):
        for g, a in zip(shuffled[pos], forward[i]):
            _assert_same(g, a, f"method {i}")
    for i in (0, len(methods) // 2, len(methods) - 1):  # alone in the pass
        for g, a in zip(score_sweep(stack, prompt, continuations, [methods[i]])[0], forward[i]):
            _assert_same(g, a, f"method {i} alone")


@pytest.mark.parametrize("make, word", [
    (lambda: Method(Confidence(2.0, probe_every=1), "copy"), "copy"),
    (lambda: Method(Confidence(2.0, probe_every=1), "backfill"), "backfill"),
    (lambda: Method(Contrastive(0.5, contrastive_output=True, probe_every=1)), "contrastive_output"),
    (lambda: STRATEGIES.get("ead").from_options(load=lambda spec: (LayerStack(tiny_model("llama", n_layers=2)),
                                                                    None), tau=2.0, small="tiny-2"), "strategy"),
])
def test_methods_outside_the_equivalence_are_refused_by_name(stack, make, word):
    assert word in sweep_refusal(make())
    with pytest.raises(ValueError, match=rf"odd-one: cannot be scored in a sweep \(.*{word}"):
        Sweep(stack, [Method(Full()), make()], names=["full", "odd-one"])


def test_a_sweep_reuses_its_grouping_across_prompts(stack):
    sweep = Sweep(stack, [Method(Confidence(h, probe_every=1)) for h in (1.0, 3.0)])
    for seed in (1, 2):
        prompt = random_prompts(1, [6], seed=seed)[0]
        cont = random_prompts(1, [5], seed=seed + 10)
        for got, method in zip(sweep.score(prompt, cont), sweep.methods):
            _assert_same(got[0], score_continuations(stack, prompt, cont, method)[0], f"seed {seed}")


def test_methods_of_one_kind_walk_together_and_score_as_alone(stack, profiles, monkeypatch):
    """Points of one criterion along its knob, with one estimator, walk their probes as one ``[M, ...]`` walk (one
    estimate a probe for all); each scores exactly as it does alone, whatever its knob or minimum exit layer."""
    import emad.decode.sweep as sweep_module

    shortlist = TopK(VOCAB // 2, list(range(0, VOCAB, 2)), {1: (1.1, 0.1)})
    methods = [Method(Confidence(h0, probe_every=1)) for h0 in (0.5, 2.0, 3.0, 3.8, 4.2)]
    methods += [Method(Emad(profiles["logit", "both"], margin, min_exit_layer=1 + i % 2), estimator=shortlist)
                for i, margin in enumerate((0.0, 0.25, 0.5, 1.0))]
    methods += [Method(Emad(profiles["logit", "both"], margin, min_exit_layer=2)) for margin in (0.0, 0.5)]
    methods += [Method(SoftmaxResponse(gap, probe_every=1)) for gap in (0.05, 0.2)]
    walked = []
    real_walk = sweep_module.walk
    monkeypatch.setattr(sweep_module, "walk", lambda group, *a, **k: walked.append(len(group)) or real_walk(
        group, *a, **k))
    prompt, continuations = _cases()
    together = score_sweep(stack, prompt, continuations, methods)
    # confidence; emad through the shortlist (minimum exit layers 1 and 2 in one walk: confidence strata estimate
    # the first probe either way); emad exact; softmax
    assert sorted(walked) == [2, 2, 4, 5]
    depths = set()
    for i, (method, got) in enumerate(zip(methods, together)):
        for g, a in zip(got, score_continuations(stack, prompt, continuations, method)):
            _assert_same(g, a, f"method {i}")
            depths.update(a.depths[1:])
    assert len(depths) > 1  # the knobs exit at more than one probe


def test_segments_first_of_several_methods_is_each_methods_own():
    segments = Segments([3, 1, 4])
    torch.manual_seed(0)
    hits = torch.rand(5, 8) < 0.3  # [M, N]
    running = torch.tensor([[3, 1, 4], [2, 0, 4], [3, 1, 1], [0, 0, 0], [1, 1, 3]])  # [M, S]
    got = segments.first(hits, running)
    for j in range(5):
        assert torch.equal(got[j], segments.first(hits[j], running[j])), j
        assert torch.equal(segments.below(running)[j], segments.below(running[j])), j


def _exactly(got, want, name: str) -> None:
    """Equal to the last bit: a later sweep reusing kept states computes what a fresh pass computes."""
    _assert_same(got, want, name)
    assert got.logprobs == want.logprobs, name


@pytest.mark.parametrize("readout", ["logit", "tuned"])
def test_a_later_sweep_on_kept_states_equals_a_fresh_pass_exactly(stack, profiles, readout):
    lens = None if readout == "logit" else random_lens()
    methods = list(_family_methods(profiles, readout, lens).values())
    first, later = methods[::2], methods[1::2]  # a refinement: other values, estimators and criteria
    prompt, continuations = _cases()
    kept = {}
    Sweep(stack, first).score(prompt, continuations, kept)
    (entry,) = kept.values()
    rows = entry.rows  # nothing with a row per vocabulary entry is kept: only states and per-row values
    assert not rows._raw and not rows._whole
    assert not any(isinstance(v, torch.Tensor) and v.dim() > 1 for memo in rows._memos.values() for v in memo.values())
    fresh = Sweep(stack, later).score(prompt, continuations)
    again = Sweep(stack, later).score(prompt, continuations, kept)
    for i, (f, a) in enumerate(zip(fresh, again)):
        for g, w in zip(a, f):
            _exactly(g, w, f"method {i}")
    grown = Sweep(stack, methods[:3]).score(prompt, continuations + [[5, 6, 7]], kept)  # a continuation it lacks:
    for g, w in zip(grown[0], score_continuations(stack, prompt, continuations + [[5, 6, 7]], methods[0])):
        _assert_same(g, w, "a new continuation")  # the pass runs again


def test_contrastive_in_a_sweep_reads_out_only_the_blocks_of_rows_still_running(stack):
    """Its shared log-probabilities, JSDs and contrasts are computed in blocks of MEMO_BLOCK rows, at each probe
    only the blocks that cover the longest prefix of rows one of its methods still runs there (what their exits
    say), and every method still equals its own scoring."""
    prompt = random_prompts(1, [5], seed=7)[0]
    continuation = random_prompts(1, [5 * MEMO_BLOCK + 1], seed=8)[0]  # 5 blocks of scored positions
    methods = [Method(Contrastive(t, alpha=0.2, probe_every=1)) for t in (0.2, 0.4, 0.6)]
    kept = {}
    together = Sweep(stack, methods).score(prompt, [continuation], kept)
    depths = []
    for method, got in zip(methods, together):
        _assert_same(got[0], score_continuations(stack, prompt, [continuation], method)[0], repr(method))
        depths.append(got[0].depths[1:])  # each position's exit layer
    (entry,) = kept.values()
    shared = entry.rows
    starts: dict[int, set[int]] = {}  # layer -> the blocks whose contrast was computed there
    for memo in shared._memos.values():
        for key in memo:
            if key[0] == "contrast" and key[-1] == "top":
                starts.setdefault(key[1], set()).add(key[-2])
    assert starts
    for layer, computed in starts.items():  # a method runs layer on the positions before its first shallower exit
        running = max(next((i for i, d in enumerate(ds) if d < layer), len(ds)) for ds in depths)
        assert computed == set(range(0, running, MEMO_BLOCK)), layer
    assert min(map(len, starts.values())) < 5  # some probe skipped rows no method runs there
