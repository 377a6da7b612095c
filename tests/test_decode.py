"""The decode loop: full depth ≡ HF greedy generate, fixed(m) ≡ HF truncated to m layers, batch ≡ rows alone."""

from __future__ import annotations

import pytest
import torch

from emad.decode import ContextLengthError, Method, Prefills, Sampling, generate, score
from emad.engine.stack import LayerStack
from emad.exits.criteria import CRITERIA, Fixed, Full
from tests.tiny import ARCHITECTURES, TinyTokenizer, random_prompts, tiny_model

NEW = 32


def _hf_greedy(model, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    return out[:, width:].tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("lengths", [[7], [11, 4, 8, 6]], ids=["batch1", "batch4-mixed"])
def test_full_depth_greedy_equals_hf_generate(arch, lengths):
    model = tiny_model(arch)
    prompts = random_prompts(len(lengths), lengths, seed=3)
    ours = generate(LayerStack(model), TinyTokenizer(), prompts, Full(), NEW, eos_token_ids=[])
    assert ours.token_ids == _hf_greedy(model, prompts)
    assert all(d == [4] * NEW for d in ours.depths)
    assert ours.cost_ratio() == pytest.approx(1.0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("m", [1, 3])
def test_fixed_depth_equals_hf_truncated(arch, m):
    prompts = random_prompts(2, [9, 5], seed=4)
    ours = generate(LayerStack(tiny_model(arch)), TinyTokenizer(), prompts, Fixed(m), NEW, eos_token_ids=[])
    assert ours.token_ids == _hf_greedy(tiny_model(arch, n_layers=m), prompts)
    assert all(d == [m] * NEW for d in ours.depths)
    assert ours.cost_ratio() < 1.0


def test_fixed_full_depth_is_full():
    model = tiny_model("llama")
    prompts = random_prompts(2, [6, 9], seed=5)
    a = generate(LayerStack(model), TinyTokenizer(), prompts, Fixed(4), 16, eos_token_ids=[])
    b = generate(LayerStack(model), TinyTokenizer(), prompts, Full(), 16, eos_token_ids=[])
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_reused_prompt_pass_gives_the_generation_made_afresh_untimed(arch):
    """Prefills: the prompts' pass made once, every later generation of them to the same depth or a shallower one
    copies it (its first layers, its last states after the layer it reads) — tokens, depths, log-probabilities and
    FLOPs bit for bit as a generation that runs its own prefill; only it is untimed. A deeper pass replaces a
    shallower one."""
    stack = LayerStack(tiny_model(arch))
    prompts = random_prompts(3, [6, 9, 4], seed=7)
    store = Prefills()
    for criterion in (Fixed(3), Full(), CRITERIA.get("confidence")(threshold=100.0), Fixed(2), Fixed(3), Full()):
        method = Method(criterion)
        fresh = generate(stack, TinyTokenizer(), prompts, method, 12, eos_token_ids=[])
        kept = generate(stack, TinyTokenizer(), prompts, method, 12, eos_token_ids=[], prefills=store)
        assert kept.token_ids == fresh.token_ids and kept.depths == fresh.depths and kept.flops == fresh.flops
        assert kept.bytes == fresh.bytes and kept.full_flops == fresh.full_flops
        assert [[t.logprob for t in row] for row in kept.traces] == [[t.logprob for t in row] for row in fresh.traces]
        assert fresh.timed and not kept.timed
    assert [depth for _, depth, *_ in store._passes.values()] == [stack.n_layers]  # one pass, to depth L
    for new in (5, 20):  # generations with less or more room for new tokens reuse it too
        fresh = generate(stack, TinyTokenizer(), prompts, Method(Fixed(3)), new, eos_token_ids=[])
        kept = generate(stack, TinyTokenizer(), prompts, Method(Fixed(3)), new, eos_token_ids=[], prefills=store)
        assert (kept.token_ids, kept.depths, kept.flops) == (fresh.token_ids, fresh.depths, fresh.flops)
        assert [[t.logprob for t in row] for row in kept.traces] == [[t.logprob for t in row] for row in fresh.traces]
    assert len(store._passes) == 1
    assert min(d for row in generate(stack, TinyTokenizer(), prompts, Method(CRITERIA.get("confidence")(
        threshold=100.0)), 12, eos_token_ids=[]).depths for d in row) < stack.n_layers  # it exits early


def test_the_pass_store_keeps_at_most_its_bytes_dropping_the_least_recently_used():
    stack = LayerStack(tiny_model("llama"))
    sets = {name: random_prompts(3, [6, 9, 4], seed=seed) for name, seed in (("a", 7), ("b", 8), ("c", 9))}
    one = Prefills()
    generate(stack, TinyTokenizer(), sets["a"], Method(Full()), 12, eos_token_ids=[], prefills=one)
    size = one.held  # one pass to depth L
    store = Prefills(max_bytes=2 * size)
    for name in ("a", "b", "a", "c"):  # a is used again before c comes: b is dropped
        kept = generate(stack, TinyTokenizer(), sets[name], Method(Full()), 12, eos_token_ids=[], prefills=store)
        fresh = generate(stack, TinyTokenizer(), sets[name], Method(Full()), 12, eos_token_ids=[])
        assert kept.token_ids == fresh.token_ids and kept.depths == fresh.depths
        assert store.held <= 2 * size
    assert [key[0] for key in store._passes] == [tuple(map(tuple, sets[n])) for n in ("a", "c")]
    none = Prefills(max_bytes=size - 1)  # a pass larger than the store is not kept
    generate(stack, TinyTokenizer(), sets["a"], Method(Full()), 12, eos_token_ids=[], prefills=none)
    assert none.held == 0


def test_batch_equals_rows_alone():
    model = tiny_model("qwen3")
    stack = LayerStack(model)
    prompts = random_prompts(4, [10, 3, 7, 12], seed=6)
    batch = generate(stack, TinyTokenizer(), prompts, Full(), 20, eos_token_ids=[])
    for i, p in enumerate(prompts):
        alone = generate(stack, TinyTokenizer(), [p], Full(), 20, eos_token_ids=[])
        assert alone.token_ids[0] == batch.token_ids[i]


def test_eos_stops_a_row_and_others_continue():
    model = tiny_model("llama")
    stack = LayerStack(model)
    prompts = random_prompts(3, [5, 8, 6], seed=7)
    free = generate(stack, TinyTokenizer(), prompts, Full(), 12, eos_token_ids=[])
    eos = free.token_ids[1][3]  # row 1 produces this at its 4th token
    stopped = generate(stack, TinyTokenizer(), prompts, Full(), 12, eos_token_ids=[eos])
    first = free.token_ids[1].index(eos)
    assert stopped.token_ids[1] == free.token_ids[1][: first + 1]
    assert stopped.finish_reasons[1] == "eos"
    for r in (0, 2):
        ids = free.token_ids[r]
        expect = ids[: ids.index(eos) + 1] if eos in ids else ids
        assert stopped.token_ids[r] == expect


def test_stop_string_cuts_text():
    model = tiny_model("gpt2")
    stack = LayerStack(model)
    prompt = random_prompts(1, [5], seed=8)
    free = generate(stack, TinyTokenizer(), prompt, Full(), 10, eos_token_ids=[])
    stop = f"t{free.token_ids[0][4]}"
    out = generate(stack, TinyTokenizer(), prompt, Full(), 10, stop_strings=[stop], eos_token_ids=[])
    assert out.finish_reasons[0] == "stop_string"
    assert stop not in out.texts[0]
    assert len(out.token_ids[0]) <= 5


def test_seeded_sampling_is_reproducible_and_differs_from_greedy():
    model = tiny_model("llama")
    stack = LayerStack(model)
    prompt = random_prompts(2, [6, 4], seed=9)
    s = Sampling(do_sample=True, temperature=1.5, top_p=0.95, seed=123)
    a = generate(stack, TinyTokenizer(), prompt, Full(), 24, sampling=s, eos_token_ids=[])
    b = generate(stack, TinyTokenizer(), prompt, Full(), 24, sampling=s, eos_token_ids=[])
    g = generate(stack, TinyTokenizer(), prompt, Full(), 24, eos_token_ids=[])
    assert a.token_ids == b.token_ids
    assert a.token_ids != g.token_ids


def test_score_equals_hf_logprobs_and_fixed_equals_truncated():
    ids = random_prompts(1, [16], seed=10)[0]
    model = tiny_model("opt")
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
        ref = ref.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        trunc = tiny_model("opt", n_layers=2)
        ref2 = torch.log_softmax(trunc(torch.tensor([ids])).logits[0, :-1], -1)
        ref2 = ref2.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(score(LayerStack(model), ids), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(score(LayerStack(model), ids, depth=2), ref2, atol=1e-4, rtol=0)


@pytest.mark.parametrize("depth", [0, 5, -1])
def test_depth_outside_range_names_valid_range(depth):
    stack = LayerStack(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"1\.\.4"):
        generate(stack, TinyTokenizer(), [[3, 4]], Fixed(depth), 4)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        score(stack, [3, 4, 5], depth=depth)


def test_prompt_longer_than_context_is_refused():
    stack = LayerStack(tiny_model("gpt2"))
    with pytest.raises(ContextLengthError, match="256"):
        generate(stack, TinyTokenizer(), [[5] * 250], Full(), 10)
    with pytest.raises(ContextLengthError, match="256"):
        score(stack, [5] * 300)


def test_unknown_criterion_lists_valid_names():
    with pytest.raises(KeyError, match="fixed, full"):
        CRITERIA.get("emadd")
