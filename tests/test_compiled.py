"""The compiled engine (segments between probes compiled over static caches, :mod:`emad.engine.compiled`) equals
the eager engine token for token, in depths and in FLOPs, for every exit family, estimator, readout, KV policy and
batch exit rule, at batch 1 and 4; full depth on it equals HF greedy; segments are compiled once per layout; bad
engine names are refused naming the valid ones."""

from __future__ import annotations

import pytest
import torch

from emad.calibration.calibrate import calibrate, windows
from emad.calibration.profile import smooth
from emad.decode import Method, Prefills, generate
from emad.engine.compiled import CompiledStack
from emad.engine.engines import check_engine, resolve_engine, with_engine
from emad.engine.stack import LayerStack
from emad.engine.static_cache import CacheFullError, StaticKVCache
from emad.exits.criteria import Confidence, Emad, Fixed, Full, SoftmaxResponse
from emad.exits.estimators import LowRank, TopK
from emad.exits.strata import Strata
from tests.cuda_like import ReplayedOnCPU, StepReplayedOnCPU, as_on_cuda
from tests.test_decode import _hf_greedy
from tests.test_readouts import random_lens
from tests.tiny import ARCHITECTURES, TinyTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer()
NEW = 10


@pytest.fixture(scope="module")
def eager():
    return LayerStack(tiny_model("llama"))


# The equality matrix compiles with dynamo + AOT autograd and runs the traced graphs (backend aot_eager): the same
# static-shape functions, masks and lanes the GPU runs, without inductor's C++ build of each (minutes on two cores).
# Inductor itself, the default backend, is exercised by the tests that use `inductor` and by the benchmark's test.
MATRIX_BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def compiled(eager):
    return CompiledStack(eager, MATRIX_BACKEND)


@pytest.fixture(scope="module")
def inductor():
    return CompiledStack(LayerStack(tiny_model("llama")))


@pytest.fixture(scope="module")
def profile(eager):
    stats = calibrate(eager, windows(random_prompts(12, [24], seed=11), 24), [1, 2, 3, 4], Strata(), batch_size=4)
    return smooth(stats, min_count=5)


def _methods(profile) -> dict:
    lens = random_lens()
    return {
        "full": lambda: Method(Full()),
        "fixed": lambda: Method(Fixed(2)),
        "confidence": lambda: Method(Confidence(3.0, probe_every=1)),
        "emad-exact": lambda: Method(Emad(profile, 0.0)),
        "emad-topk": lambda: Method(Emad(profile, 0.0), "monotone", TopK(48)),
        "emad-lowrank": lambda: Method(Emad(profile, 0.0), "monotone", LowRank(32)),
        "emad-tuned": lambda: Method(Emad(profile, 0.0), readout=lens),
        "softmax": lambda: Method(SoftmaxResponse(0.1, probe_every=1)),
        "confidence-copy": lambda: Method(Confidence(3.0, probe_every=1), "copy"),
        "confidence-copy-translated": lambda: Method(Confidence(3.0, probe_every=1), "copy-translated",
                                                     readout=lens),
        "confidence-backfill": lambda: Method(Confidence(3.0, probe_every=1), "backfill"),
        "confidence-sync": lambda: Method(Confidence(3.6, probe_every=1), batch_exit="sync"),
    }


NAMES = list(_methods(None))


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.depths == b.depths
    assert a.flops == b.flops and a.full_flops == b.full_flops
    assert [[t.reason for t in row] for row in a.traces] == [[t.reason for t in row] for row in b.traces]


AT_BATCH_1 = ("full", "emad-exact", "confidence-backfill")  # the rest at batch 1 in the heavy suite (compile time)


@pytest.mark.parametrize(("name", "batch"), [(n, 4) for n in NAMES] + [
    pytest.param(n, 1, marks=() if n in AT_BATCH_1 else pytest.mark.heavy) for n in NAMES])
def test_compiled_equals_eager_in_tokens_depths_and_flops(eager, compiled, profile, name, batch):
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)[-batch:]  # the last row exits under every family
    method = _methods(profile)[name]
    a = generate(eager, TOK, prompts, method(), NEW)
    b = generate(compiled, TOK, prompts, method(), NEW)
    _same(a, b)
    if name not in ("full", "fixed"):  # the comparison covers exits, not only full-depth tokens
        assert any(d < 4 for row in a.depths for d in row[1:]), f"{name} never exited: the test would prove little"


@pytest.mark.parametrize("name", ["emad-exact", "emad-topk", "emad-tuned",
                                  *(pytest.param(n, marks=pytest.mark.heavy) for n in ("emad-lowrank", "softmax"))])
def test_probes_compiled_over_every_row_equal_eager_probes(eager, profile, name):
    """What a GPU runs: each fusable probe (readout + estimator) compiled over every cache row."""
    fused = CompiledStack(eager, MATRIX_BACKEND, fuse_probes=True)
    assert fused.fuses(_methods(profile)[name]().estimator)
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    method = _methods(profile)[name]
    _same(generate(eager, TOK, prompts, method(), NEW), generate(fused, TOK, prompts, method(), NEW))


def test_compiled_probes_serve_later_points_with_equal_estimators_without_compiling(eager, profile):
    fused = CompiledStack(eager, MATRIX_BACKEND, fuse_probes=True)
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    for margin in (0.0, 0.5):
        generate(fused, TOK, prompts, Method(Emad(profile, margin), "monotone", TopK(48)), NEW)
    before = fused.runner.stats.compilations
    for margin in (0.0, 0.5):  # new points: new estimator objects (shortlist rows made afresh), equal options
        generate(fused, TOK, prompts, Method(Emad(profile, margin), "monotone", TopK(48)), NEW)
    assert fused.runner.stats.compilations == before


def test_full_depth_on_the_inductor_compiled_engine_equals_hf_greedy_and_probes_equal_eager(eager, inductor, profile):
    prompts = random_prompts(4, [4, 11, 8, 6], seed=7)
    out = generate(inductor, TOK, prompts, Full(), NEW)
    assert out.token_ids == _hf_greedy(eager.model, prompts, NEW)
    method = _methods(profile)["confidence-copy"]
    _same(generate(eager, TOK, prompts, method(), NEW), generate(inductor, TOK, prompts, method(), NEW))
    assert inductor.runner.backend == "inductor" and inductor.runner.stats.compilations > 1


def test_a_reused_prompt_pass_on_the_compiled_engine_gives_the_same_generation(compiled, profile):
    prompts = random_prompts(2, [6, 9], seed=5)
    method = _methods(profile)["emad-exact"]
    fresh = generate(compiled, TOK, prompts, method(), NEW)
    shared = Prefills()
    first = generate(compiled, TOK, prompts, method(), NEW, prefills=shared)
    again = generate(compiled, TOK, prompts, method(), NEW, prefills=shared)
    _same(fresh, first)
    _same(fresh, again)


def test_a_layout_seen_before_compiles_nothing_again(compiled, profile):
    prompts = random_prompts(1, [7], seed=9)
    methods = _methods(profile)
    generate(compiled, TOK, prompts, methods["confidence"](), NEW)
    generate(compiled, TOK, prompts, methods["fixed"](), NEW)
    stats = compiled.runner.stats
    before = stats.compilations
    for name in ("confidence", "fixed", "emad-exact", "softmax"):  # layouts already compiled: [1, 2, 3, 4], [2]
        generate(compiled, TOK, random_prompts(1, [11], seed=2), methods[name](), NEW)
    assert stats.compilations == before
    assert len(set(stats.layouts)) == len(stats.layouts)  # each (segment, batch, capacity) compiled once
    generate(compiled, TOK, prompts, Fixed(3), NEW)  # a new layout: one new segment, [0, 3)
    assert stats.compilations == before + 1
    assert stats.seconds > 0


def test_static_caches_share_a_slab_one_generation_at_a_time(compiled):
    first = compiled.new_cache(2, 20)
    assert isinstance(first, StaticKVCache) and first.capacity % 128 == 0
    second = compiled.new_cache(2, 20)  # the slab is lent to `first`: `second` gets tensors of its own
    assert second.slab is not first.slab
    slab = first.slab
    del first
    assert compiled.new_cache(2, 20).slab is slab
    big = compiled.new_cache(2, 300)  # a longer generation: a larger slab, which shorter ones reuse from then on
    assert big.capacity == 384 and big.slab is not slab
    del big
    assert compiled.new_cache(2, 20).capacity == 384
    with pytest.raises(CacheFullError, match="holds 128 slots"):
        second.allocate(torch.ones(2, 129, dtype=torch.bool))


def test_engine_names_are_checked_and_auto_picks_by_device(eager):
    with pytest.raises(ValueError, match="decode.engine must be one of auto, eager, compiled, compiled-if, "
                                         "compiled-lookahead; got .jit."):
        check_engine("jit")
    assert resolve_engine("auto", "cuda") == "compiled" and resolve_engine("auto", "cpu") == "eager"
    assert with_engine(eager, "eager") is eager
    assert with_engine(eager, "compiled").engine == "compiled"


def test_a_bad_decode_engine_in_params_names_the_valid_values():
    from emad.evaluation.config import DecodeConfig

    with pytest.raises(ValueError, match="decode.engine must be one of auto, eager, compiled"):
        DecodeConfig(domains={"d": ["perplexity"]}, engine="fast")


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_decodes_on_the_compiled_engine_as_on_the_eager_one(arch):
    """Every row of the adapter table (rotary or learned positions, sliding windows, softcapping, fused QKV):
    full depth ≡ HF greedy, and a probing method ≡ the eager engine, at batch 2."""
    stack = LayerStack(tiny_model(arch))
    compiled = CompiledStack(stack)
    prompts = random_prompts(2, [5, 9], seed=1)
    assert generate(compiled, TOK, prompts, Full(), NEW).token_ids == _hf_greedy(stack.model, prompts, NEW)
    method = lambda: Method(Confidence(3.0, probe_every=2))  # noqa: E731
    _same(generate(stack, TOK, prompts, method(), NEW), generate(compiled, TOK, prompts, method(), NEW))


@pytest.mark.heavy
def test_fused_probes_and_readouts_compiled_by_inductor_equal_eager(eager, profile):
    """The path a GPU runs, compiled by inductor (graphs aside): probes and exit readouts over every row."""
    fused = CompiledStack(eager, fuse_probes=True)
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    for name in ("emad-exact", "emad-topk", "emad-tuned", "full"):
        method = _methods(profile)[name]
        _same(generate(eager, TOK, prompts, method(), NEW), generate(fused, TOK, prompts, method(), NEW))
    assert any(str(key[0]).startswith("settle") for key in fused.runner.stats.layouts)  # probes compiled


GRAPHED = ("full", "fixed", "emad-exact", "emad-topk", "emad-tuned", "confidence-copy", "confidence-backfill",
           "confidence-sync")


@pytest.fixture(scope="module")
def graphed():
    """A compiled engine of its own model that captures graphs and fuses probes, as on CUDA, with CPU replays."""
    return as_on_cuda(LayerStack(tiny_model("llama")), MATRIX_BACKEND)


@pytest.mark.parametrize("name", [n if n in ("full", "emad-topk", "confidence-backfill") else
                                  pytest.param(n, marks=pytest.mark.heavy) for n in GRAPHED])
def test_the_graph_replayed_path_equals_eager_generation_after_generation(graphed, profile, name):
    """What CUDA runs, under a graph's rules (:class:`ReplayedOnCPU`): segments, fused probes and exit readouts
    replayed on the slabs' buffers equal the eager engine at batch 4, for a first generation and for later ones of
    other prompt lengths on the same slab (stale K/V from the one before left in it)."""
    eager = LayerStack(graphed.model)
    method = _methods(profile)[name]
    before = ReplayedOnCPU.replays + StepReplayedOnCPU.replays
    for seed, lengths in ((3, [5, 9, 7, 12]), (4, [11, 3, 8, 6]), (5, [2, 14, 9, 4])):
        prompts = random_prompts(4, lengths, seed=seed)
        _same(generate(eager, TOK, prompts, method(), NEW), generate(graphed, TOK, prompts, method(), NEW))
    replays = ReplayedOnCPU.replays + StepReplayedOnCPU.replays
    assert graphed.runner.stats.graphs > 0 and replays > before  # the replayed path ran


def test_states_a_drafter_keeps_across_replays_stay_its_own(graphed):
    """A self-drafter keeps each draft's layer-E state until verification, past later replays of the segment that
    made it: on replayed graphs speculative decoding still reproduces the target's greedy tokens."""
    from emad.methods import SelfDrafter, Static, speculative_generate

    eager = LayerStack(graphed.model)
    for prompt in random_prompts(2, [5, 9], seed=1):
        target = generate(eager, TOK, [prompt], Full(), 16, eos_token_ids=[]).token_ids[0]
        drafted = speculative_generate(graphed, TOK, prompt, SelfDrafter(2), 16, Static(3), eos_token_ids=[])
        assert drafted.token_ids == target and sum(drafted.accepted_lengths) > 0


def test_a_static_cache_made_inside_inference_mode_serves_generations_outside_it(compiled):
    """Slabs are normal tensors wherever they are made: a slab first made under ``torch.inference_mode`` (a scoring
    pass) is reset by a cache made outside it, and the compiled segments' guards accept both."""
    with torch.inference_mode():
        cache = compiled.new_cache(3, 20)
    assert not cache.valid.is_inference() and not cache.slot_tensor(0).is_inference()
    del cache
    prompts = random_prompts(3, [4, 6, 5], seed=13)
    generate(compiled, TOK, prompts, Full(), NEW)  # on the slab made above


def test_a_model_and_its_compiled_runner_are_freed_together(profile):
    """Runners (their compiled functions, graphs and slabs refer to the model) go with the model: no registry keeps
    it alive after its last reference is dropped."""
    import gc
    import weakref

    model = tiny_model("llama")
    alive = weakref.ref(model)
    stack = as_on_cuda(LayerStack(model), MATRIX_BACKEND)
    generate(stack, TOK, random_prompts(2, [5, 7]), Method(Emad(profile, 0.0), "monotone", TopK(48)), 4)
    generate(stack, TOK, random_prompts(2, [5, 7]), Method(Confidence(3.0, probe_every=2), "copy"), 4)
    assert stack.runner.stats.compilations > 0 and stack.runner.stats.graphs > 0
    del model, stack
    gc.collect()
    assert alive() is None
