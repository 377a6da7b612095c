"""A sweep scores a batch of requests in one pass: each request gets what it gets scored alone (exits and FLOPs
equal, NLLs within the verdict's noise rule), and its batch-mates never change its scores."""

from __future__ import annotations

import random

import pytest
import torch
import transformers as tf

from emad.decode import Method
from emad.decode.batches import request_batches
from emad.decode.sweep import Sweep
from emad.engine.stack import LayerStack
from emad.evaluation.metrics import WINDOW_NOISE
from emad.exits.criteria import Confidence, Contrastive, Fixed, Full, SoftmaxResponse
from emad.exits.estimators import Prune, TopK
from tests.test_readouts import random_lens
from tests.test_sweep import _family_methods, profiles, stack  # noqa: F401 - fixtures shared with the sweep's tests
from tests.tiny import VOCAB, _spread_weights


def _mixed(vocab: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """Perplexity windows (equal lengths), prompts with one continuation of another length, and choice items (one
    prompt, continuations of different lengths, one of a single token)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    windows = [(ids(8), [ids(13)]) for _ in range(3)]
    prompts = [(ids(n), [ids(m)]) for n, m in ((5, 7), (11, 4), (3, 16))]
    choices = [(ids(n), [ids(m) for m in lengths]) for n, lengths in ((9, (3, 5, 1, 4)), (6, (2, 6, 4, 3)))]
    return windows + prompts + choices


def _close(got, want, name: str) -> None:
    """Exits and FLOPs equal, the summed NLL within the verdict's window noise, every token within 1e-4 nats."""
    assert got.depths == want.depths, name
    assert got.greedy == want.greedy, name
    assert got.flops == want.flops, name
    assert got.full_flops == want.full_flops, name
    assert got.nll == want.nll or abs(got.nll - want.nll) <= WINDOW_NOISE, name  # equal where infinite (pruning)
    assert all(a == b or abs(a - b) <= 1e-4 for a, b in zip(got.logprobs, want.logprobs)), name


def _each_alone(sweep: Sweep, requests) -> list:
    return [sweep.score(prompt, continuations) for prompt, continuations in requests]


def _compare(batched, alone, names) -> None:
    for r, (b, a) in enumerate(zip(batched, alone, strict=True)):
        for name, got_row, want_row in zip(names, b, a, strict=True):
            for c, (got, want) in enumerate(zip(got_row, want_row, strict=True)):
                _close(got, want, f"request {r} continuation {c}: {name}")


@pytest.mark.parametrize("readout", ["logit", "tuned"])
def test_a_batch_of_mixed_requests_gives_each_request_its_own_scores(stack, profiles, readout):  # noqa: F811
    """Every family and estimator the sweep serves (the tiny model): windows, prompts and choice items together."""
    methods = _family_methods(profiles, readout, None if readout == "logit" else random_lens())
    sweep = Sweep(stack, list(methods.values()), list(methods))
    requests = _mixed(VOCAB, seed=1)
    _compare(sweep.score_batch(requests), _each_alone(sweep, requests), list(methods))


def test_padding_never_leaks_a_requests_scores_do_not_depend_on_its_batch_mates(stack, profiles):  # noqa: F811
    methods = list(_family_methods(profiles, "logit", None).values())[::3]
    sweep = Sweep(stack, methods)
    requests = _mixed(VOCAB, seed=2)
    base = sweep.score_batch(requests)
    order = list(range(len(requests)))
    random.Random(0).shuffle(order)
    permuted = sweep.score_batch([requests[i] for i in order])
    others = _mixed(VOCAB, seed=3)  # other batch-mates: longer and shorter prompts around request 4
    mixed = sweep.score_batch([others[0], requests[4], *others[5:]])
    for pos, i in enumerate(order):
        _compare([permuted[pos]], [base[i]], [str(j) for j in range(len(methods))])
    _compare([mixed[1]], [base[4]], [str(j) for j in range(len(methods))])


def test_strategies_a_sweep_serves_score_as_they_score_alone(stack):  # noqa: F811
    """Speculative decoding scores as full depth (lossless); EAD with a self pair replays the shared pass's readouts
    at k and L: in a batch beside per-token methods, each request gets what the strategy gives alone."""
    from emad.decode import score_continuations
    from emad.methods import STRATEGIES

    lens = random_lens()
    strategies = {"ead": STRATEGIES.get("ead").from_options(tau=2.5, small_layers=2, window=2, d_min=2),
                  "ead-large": STRATEGIES.get("ead").from_options(tau=0.5, small_layers=3, start="large"),
                  "speculative": STRATEGIES.get("speculative").from_options(exit_layer=2, max_draft=3)}
    strategies["ead-tuned"] = STRATEGIES.get("ead").from_options(tau=2.5, small_layers=2, window=2, d_min=2)
    strategies["ead-tuned"].readout = lens
    methods = {**strategies, "full": Method(Full()), "confidence": Method(Confidence(3.0, probe_every=1))}
    requests = _mixed(VOCAB, seed=5)
    together = Sweep(stack, list(methods.values()), list(methods)).score_batch(requests)
    depths = set()
    for r, (prompt, continuations) in enumerate(requests):
        for j, (name, method) in enumerate(methods.items()):
            for c, (got, want) in enumerate(zip(together[r][j], score_continuations(stack, prompt, continuations,
                                                                                     method))):
                _close(got, want, f"request {r} continuation {c}: {name}")
                depths.update(got.depths if name.startswith("ead") else ())
    assert {2, 4} <= depths  # both models produced tokens


def _smollm2_shaped(seed: int = 0) -> LayerStack:
    """A random fp32 model of SmolLM2-135M's shape (30 layers, d 576, 9 heads of which 3 K/V, vocab 49,152, tied
    head), seeded; its weights spread as the tiny models' are, the head's 3x more (readouts of 1-5 nats)."""
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                            rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    _spread_weights(model, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return LayerStack(model)


def _thresholds(entropies: torch.Tensor, quantiles) -> list[float]:
    """Thresholds at ``quantiles`` of ``entropies``, each the midpoint of a gap between neighbouring values: far
    from every estimate, so that no exit decision rests on rounding."""
    values = entropies.flatten().sort().values
    gaps = (values[1:] - values[:-1]) > 1e-3
    out = []
    for q in quantiles:
        i = int(q * (len(values) - 2))
        i = i + int(gaps[i:].nonzero()[0])
        out.append(float(values[i] + values[i + 1]) / 2)
    return out


@pytest.mark.slow
def test_a_batch_equals_each_request_alone_on_a_model_of_smollm2s_shape():
    model = _smollm2_shaped()
    vocab = model.vocab_size
    requests = [_mixed(vocab, seed=4)[i] for i in (0, 3, 5, 6)]  # a window, two prompts, a choice item
    with torch.inference_mode():  # the exact entropies the criteria will read, to place thresholds away from them
        ids = torch.tensor([requests[0][0] + requests[0][1][0]])
        h = model.embed(ids, torch.arange(ids.shape[1])[None])
        cache = model.new_cache(1, ids.shape[1])
        slots = cache.allocate(torch.ones_like(ids, dtype=torch.bool))
        entropies = []
        for layer in range(3, 31, 3):
            h = model.run(h, layer - 3, layer, cache, torch.arange(ids.shape[1])[None], slots)
            logits = model.readout(h[0], layer).float()
            entropies.append(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))
    entropies = torch.stack(entropies)
    shortlist = list(range(0, vocab, 97))
    methods = {"full": Method(Full()), "fixed-15": Method(Fixed(15)), "fixed-29": Method(Fixed(29))}
    for h0 in _thresholds(entropies, (0.2, 0.5, 0.8)):
        methods[f"confidence-{h0:.4f}"] = Method(Confidence(h0))
    topk = TopK(len(shortlist), shortlist)
    methods["confidence-topk"] = Method(Confidence(2.0), estimator=topk)
    methods["softmax"] = Method(SoftmaxResponse(0.2))
    methods["softmax-prune"] = Method(SoftmaxResponse(0.2), estimator=Prune(256))
    methods["contrastive"] = Method(Contrastive(0.9, alpha=0.1))
    sweep = Sweep(model, list(methods.values()), list(methods))
    _compare(sweep.score_batch(requests), _each_alone(sweep, requests), list(methods))


def test_batches_take_the_longest_requests_first_keep_a_prompt_s_requests_together_and_bound_tokens():
    requests = [([1] * 5, [[2] * 3]), ([1] * 9, [[2] * 2, [3] * 4]), ([4] * 5, [[2] * 3]), ([1] * 5, [[5] * 3]),
                ([1] * 2, [[2] * 1])]
    assert request_batches(requests, 2) == [[1], [0, 3], [2, 4]]  # equal prompts (0 and 3) in one batch
    assert request_batches(requests, 1) == [[1], [0], [3], [2], [4]]
    assert request_batches(requests, 8, tokens=26) == [[1], [0, 3, 2], [4]]  # 2 rows x 13 slots; 3 x 8; 4 x 8 > 26
    assert request_batches(requests, 8, tokens=5) == [[1], [0, 3], [2], [4]]  # over the bound alone: a batch
    assert request_batches([], 4) == []
    assert request_batches(requests, "auto", tokens=26) == request_batches(requests, 8, tokens=26)  # tokens alone
    for size, tokens in ((0, None), (2, 0), ("many", None), (True, None)):
        with pytest.raises(ValueError, match="decode.sweep_batch"):
            request_batches(requests, size, tokens)


def test_bad_batch_params_name_the_key_and_the_valid_values_before_any_work():
    from emad.config import ConfigError, validate_section
    from emad.evaluation.config import DecodeConfig

    base = {"domains": {"toy": ["perplexity", "fidelity"]}}
    for key, value, words in (("sweep_batch", 0, "whole number >= 1, or auto"), ("sweep_batch", "big", "auto"),
                              ("sweep_batch_tokens", 0, "whole number >= 1, or null")):
        with pytest.raises(ConfigError, match=rf"decode.{key}.*{words}"):
            validate_section("decode", {**base, key: value}, DecodeConfig)
    assert validate_section("decode", {**base, "sweep_batch": "auto"}, DecodeConfig).sweep_batch == "auto"


def test_an_auto_batch_fills_a_share_of_the_free_memory(stack):  # noqa: F811
    from emad.decode.batches import Batching, auto_tokens, token_bytes

    methods = [Method(Full()), Method(Confidence(1.0))]
    per = token_bytes(stack, methods)
    assert token_bytes(stack, [*methods, Method(Contrastive(0.5))]) > per  # contrastive keeps every probe's rows
    assert auto_tokens(stack, methods) >= 256
    assert Batching.of("auto", None, stack, methods).tokens == auto_tokens(stack, methods)
    assert Batching.of("auto", 1000, stack, methods) == Batching("auto", 1000)  # a given bound stands
