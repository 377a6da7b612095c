"""The decode step whose state lives on the device (:mod:`emad.decode.device_step`) equals the host step it replaces
(:func:`emad.decode.step.step`, "today's eager engine"): tokens, depths, FLOPs, exit reasons, first allowed layers,
entropies and the KV buffers, for every family that keeps its state on the device, at batch 1 and 4, for three
generations on one slab — on the eager engine (bit for bit), and on the compiled engine as CUDA runs it, one graph
per token with conditional nodes or graphs per block with lookahead (graphs replayed on the CPU:
:mod:`tests.cuda_like`). Inside a step nothing reads the device: the host reads one record per token and launches
one graph."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from emad.calibration.calibrate import calibrate, windows
from emad.calibration.profile import smooth
from emad.decode import Method, generate
from emad.decode.device_step import uses_device_state
from emad.decode.steppers import Mailbox
from emad.engine.engines import resolve_engine, with_engine
from emad.engine.stack import LayerStack
from emad.engine.step_graphs import Always
from emad.exits.criteria import Confidence, Contrastive, Emad, Fixed, Full, SoftmaxResponse
from emad.exits.estimators import LowRank, Prune, TopK
from emad.exits.strata import Strata
from tests.cuda_like import DEVICE_SIDE, Conditional, ReplayedOnCPU, StepReplayedOnCPU, as_on_cuda
from tests.test_readouts import random_lens
from tests.tiny import TinyTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer()
NEW = 10
BACKEND = "aot_eager"  # dynamo + AOT autograd, the traced graphs run as they are (inductor's C++ builds take minutes)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def profile(model):
    stack = LayerStack(model)
    stats = calibrate(stack, windows(random_prompts(12, [24], seed=11), 24), [1, 2, 3, 4], Strata(), batch_size=4)
    return smooth(stats, min_count=5)


@pytest.fixture(scope="module")
def host(model):
    """Today's eager engine: every method on the host step."""
    stack = LayerStack(model)
    stack.device_steps = False
    return stack


def _methods(profile) -> dict:
    lens = random_lens()
    return {
        "full": lambda: Method(Full()),
        "fixed": lambda: Method(Fixed(2)),
        "confidence": lambda: Method(Confidence(3.0, probe_every=1)),
        "softmax": lambda: Method(SoftmaxResponse(0.1, probe_every=1)),
        "emad-exact": lambda: Method(Emad(profile, 0.0)),
        "emad-topk": lambda: Method(Emad(profile, 0.0), "monotone", TopK(48)),
        "emad-lowrank": lambda: Method(Emad(profile, 0.0), "monotone", LowRank(32)),
        "emad-tuned": lambda: Method(Emad(profile, 0.0), readout=lens),
        "emad-min-exit": lambda: Method(Emad(profile, 0.0, min_exit_layer=2), "monotone", TopK(48)),
        "confidence-sync": lambda: Method(Confidence(3.6, probe_every=1), batch_exit="sync"),
    }


NAMES = list(_methods(None))
GENERATIONS = ((3, [5, 9, 7, 12]), (4, [11, 3, 8, 6]), (5, [2, 14, 9, 4]))  # three prompt sets on one slab


def _caches(stack, monkeypatch) -> list:
    """The caches generations on ``stack`` (and views made from it) make, in order (clear it before a generation on
    a compiled stack: a cache held elsewhere keeps its slab lent, and the next generation would get another)."""
    made = []
    new_cache = stack.new_cache

    def keep(batch, capacity):
        cache = new_cache(batch, capacity)
        made.append(cache)
        return cache

    monkeypatch.setattr(stack, "new_cache", keep)
    return made


def _same(a, b, exact: bool) -> None:
    """Equal tokens, depths, FLOPs, reasons and first allowed layers; entropies and log-probabilities equal (or, off
    the eager engine, within float noise: compiled segments sum in another order)."""
    assert a.token_ids == b.token_ids
    assert a.depths == b.depths
    assert a.flops == b.flops and a.full_flops == b.full_flops and a.bytes == b.bytes
    assert [[(t.reason, t.allowed) for t in row] for row in a.traces] == \
        [[(t.reason, t.allowed) for t in row] for row in b.traces]
    for row_a, row_b in zip(a.traces, b.traces):
        for x, y in zip(row_a, row_b):
            assert x.entropies.keys() == y.entropies.keys()
            if exact:
                assert (x.entropies, x.logprob) == (y.entropies, y.logprob)
            else:
                assert all(math.isclose(x.entropies[k], y.entropies[k], rel_tol=1e-5, abs_tol=1e-5)
                           for k in x.entropies)
                assert math.isclose(x.logprob, y.logprob, rel_tol=1e-5, abs_tol=1e-5)


def _same_kv(a, b) -> None:
    """The same K/V and validity at every slot the host step's cache holds; the device step's holds nothing
    valid beyond (a step launched ahead of an ending row's read writes nothing)."""
    n = a.n_slots
    assert torch.equal(a.valid[:, :, :n], b.valid[:, :, :n]) and not b.valid[:, :, n:].any()
    for layer in range(a.n_layers):
        valid = a.valid[layer, :, :n]  # [B, S]
        if a.keys[layer] is None:  # a layer no token ran (fixed depth)
            assert not valid.any() and not b.valid[layer].any()
            continue
        for mine, theirs in ((a.keys[layer], b.keys[layer]), (a.values[layer], b.values[layer])):
            torch.testing.assert_close(mine[:, :, :n].transpose(1, 2)[valid], theirs[:, :, :n].transpose(1, 2)[valid],
                                       rtol=1e-5, atol=1e-5)


def _exits(out) -> bool:
    return any(d < 4 for row in out.depths for d in row[1:])


# --------------------------------------------------------------------------------------------- the eager engine


@pytest.mark.parametrize("batch", [4, pytest.param(1, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("name", NAMES)
def test_the_device_step_on_the_eager_engine_equals_the_host_step_bit_for_bit(model, host, profile, name, batch,
                                                                              monkeypatch):
    eager = LayerStack(model)
    method = _methods(profile)[name]
    assert uses_device_state(eager, method()) and not uses_device_state(host, method())
    ours, theirs = _caches(eager, monkeypatch), _caches(host, monkeypatch)
    for seed, lengths in GENERATIONS:
        prompts = random_prompts(4, lengths, seed=seed)[-batch:]
        a, b = generate(host, TOK, prompts, method(), NEW), generate(eager, TOK, prompts, method(), NEW)
        _same(a, b, exact=True)
        _same_kv(theirs[-1], ours[-1])
        assert a.step_path == "host" and b.step_path == "device/immediate"
    if name not in ("full", "fixed"):
        assert _exits(a), f"{name} never exited: the comparison would prove little"


@pytest.mark.parametrize("name", ["emad-topk", pytest.param("confidence-sync", marks=pytest.mark.heavy)])
def test_rows_that_end_on_eos_or_a_stop_string_end_as_on_the_host_step(host, profile, name):
    """Rows end at different steps (EOS ids, a stop string): the same tokens, texts and reasons — also on the
    compiled engine, which reads each step a token late (a row ended by a stop string runs one step in vain; under
    the ``sync`` batch exit, where that step would move the other rows, it reads each step at once)."""
    graphed = _graphed("if")
    host = LayerStack(graphed.model)
    host.device_steps = False
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    method = _methods(profile)[name]
    kwargs = dict(eos_token_ids=list(range(2, 10)), stop_strings=["t7", "t31 t"])
    a = generate(host, TOK, prompts, method(), 16, **kwargs)
    assert {"eos", "stop_string"} <= set(a.finish_reasons)  # the case is exercised
    for stack in (LayerStack(graphed.model), graphed):
        b = generate(stack, TOK, prompts, method(), 16, **kwargs)
        assert (a.token_ids, a.texts, a.finish_reasons) == (b.token_ids, b.texts, b.finish_reasons)
        assert a.depths == b.depths and a.flops == b.flops


def test_families_that_keep_state_on_the_host_take_the_host_step(model, profile):
    eager = LayerStack(model)
    for method in (Method(Contrastive(0.9)), Method(Confidence(3.0), "backfill"),
                   Method(SoftmaxResponse(0.1), "monotone", Prune(8))):
        assert not uses_device_state(eager, method)
        assert generate(eager, TOK, random_prompts(2, [5, 7]), method, 4).step_path == "host"


# ------------------------------------------------------------------------------------ the compiled engine on CUDA


_GRAPHED: dict[str, object] = {}


def _graphed(branches: str):
    """The compiled engine as on CUDA (a model of its own: a runner of its own), graphs replayed on the CPU, its
    device steps taking their later blocks as ``branches`` says (one stack per way, for the whole module)."""
    if branches not in _GRAPHED:
        _GRAPHED[branches] = as_on_cuda(LayerStack(tiny_model("llama")), BACKEND, branches)
    return _GRAPHED[branches]


@pytest.fixture(scope="module", params=["if", pytest.param("lookahead", marks=pytest.mark.heavy)])
def graphed(request):
    return _graphed(request.param)


IN_MAKE_TEST = {("if", "full", 4), ("if", "emad-topk", 4), ("lookahead", "emad-topk", 4)}  # the rest: heavy


@pytest.mark.parametrize(("branches", "name", "batch"), [
    (b, n, batch) if (b, n, batch) in IN_MAKE_TEST else pytest.param(b, n, batch, marks=pytest.mark.heavy)
    for b in ("if", "lookahead") for n in NAMES for batch in (4, 1)])
def test_the_device_step_as_cuda_runs_it_equals_the_host_step(profile, branches, name, batch, monkeypatch):
    graphed = _graphed(branches)
    host = LayerStack(graphed.model)
    host.device_steps = False
    method = _methods(profile)[name]
    ours, theirs = _caches(graphed, monkeypatch), _caches(host, monkeypatch)
    path = {"if": "device/graph-if", "lookahead": "device/graph-lookahead"}[graphed.branches]
    slabs = set()
    for seed, lengths in GENERATIONS:
        prompts = random_prompts(4, lengths, seed=seed)[-batch:]
        a, b = generate(host, TOK, prompts, method(), NEW), generate(graphed, TOK, prompts, method(), NEW)
        _same(a, b, exact=False)
        _same_kv(theirs.pop(), ours[-1])
        assert b.step_path == path
        slabs.add(id(ours.pop().slab))
    assert len(slabs) == 1  # three generations on one slab, stale K/V left in it


class HostWork(TorchDispatchMode):
    """Counts what the host does outside emulated graph replays: reads of tensor values (``_local_scalar_dense``:
    ``bool()``, ``.item()``; ``nonzero``, whose size is read) and every eager aten op."""

    def __init__(self):
        super().__init__()
        self.reads = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not DEVICE_SIDE[0]:
            self.ops += 1
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                self.reads += 1
        return func(*args, **(kwargs or {}))


def _host_work(stack, method, prompts, new: int, monkeypatch) -> dict:
    """Per decode step: the host's reads and eager ops during the token loop, records read, graph launches."""
    read, launches = Mailbox.read, [ReplayedOnCPU.replays, StepReplayedOnCPU.replays]
    counted = {"records": 0}

    def record(self, handle):
        counted["records"] += 1
        return read(self, handle)

    monkeypatch.setattr(Mailbox, "read", record)
    generate(stack, TOK, prompts, method, new, eos_token_ids=[])  # built: compiled, captured
    counted["records"] = 0
    launches = [ReplayedOnCPU.replays, StepReplayedOnCPU.replays]
    with HostWork() as work:
        out = generate(stack, TOK, prompts, method, new, eos_token_ids=[])
    shorter = generate(stack, TOK, prompts, method, new - 4, eos_token_ids=[])  # the loop's share: a difference
    with HostWork() as short:
        shorter = generate(stack, TOK, prompts, method, new - 4, eos_token_ids=[])
    steps = out.decode_steps - shorter.decode_steps
    return {"reads": (work.reads - short.reads) / steps, "ops": (work.ops - short.ops) / steps,
            "records": counted["records"] / (out.decode_steps + 2 * shorter.decode_steps),
            "segment_launches": ReplayedOnCPU.replays - launches[0],
            "step_launches": (StepReplayedOnCPU.replays - launches[1]) / (out.decode_steps + 2 * shorter.decode_steps)}


def test_inside_a_step_nothing_reads_the_device_and_one_graph_is_launched_per_token(profile, monkeypatch):
    """On the path CUDA takes where it has conditional nodes: 0 reads per probe, one record read and one graph
    launch per token, and the host's eager work per token the same with ten probes as with none."""
    stack = as_on_cuda(LayerStack(tiny_model("llama", n_layers=4)), BACKEND, "if")
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    full = _host_work(stack, Method(Full()), prompts, NEW, monkeypatch)
    probing = _host_work(stack, Method(Emad(profile, math.inf), "monotone", TopK(48)), prompts, NEW, monkeypatch)
    for work in (full, probing):
        assert work["reads"] == 0 and work["records"] == 1 and work["step_launches"] == 1
        assert work["segment_launches"] == 0  # no graph of a segment of its own: the step's graph holds them
    assert probing["ops"] == full["ops"]  # four probes a token add no host work


def test_the_lookahead_path_reads_one_flag_per_later_block(profile):
    """Without conditional nodes, the host reads each later block's flag (after launching that block) and the
    record: 1 + 3 reads a token with probes at layers 1..4 and no exit."""
    stack = _graphed("lookahead")
    out = generate(stack, TOK, random_prompts(1, [6]), Method(Emad(profile, math.inf)), NEW, eos_token_ids=[])
    assert out.step_path == "device/graph-lookahead" and out.host_reads_per_step == 1 + 3
    assert out.graph_launches == out.decode_steps * (1 + 3 + 1)  # block 0, three later blocks, the finish


def test_the_host_step_reads_the_device_at_every_probe(host, profile, monkeypatch):
    """What the device step removes: the host step reads each estimated probe's decisions."""
    out = generate(host, TOK, random_prompts(1, [6]), Method(Emad(profile, math.inf)), NEW, eos_token_ids=[])
    assert out.host_reads_per_step == 1 + 3  # the token, and probes at layers 1..3 (layer 4 is read, not probed)


def test_a_new_method_with_equal_options_reuses_the_compiled_step(graphed, profile):
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    stats = graphed.runner.stats
    for margin in (0.0, 0.5):
        generate(graphed, TOK, prompts, Method(Emad(profile, margin), "monotone", TopK(48)), NEW)
    before = (stats.compilations, stats.graphs)
    for margin in (0.0, 0.25, 1.0):  # new points: new criteria, new estimator objects (shortlists made afresh)
        generate(graphed, TOK, prompts, Method(Emad(profile, margin), "monotone", TopK(48)), NEW)
    assert (stats.compilations, stats.graphs) == before
    generate(graphed, TOK, prompts, Method(Emad(profile, 0.0), "monotone", TopK(40)), NEW)  # other options: its own
    assert stats.compilations > before[0]


def test_a_conditional_node_reads_its_predicate_at_replay_and_a_skipped_body_keeps_its_buffers():
    class Program:
        """Block 0 writes 1 to ``out[0]`` and sets the flag from ``go``; block 1, under the flag, writes 2."""

        def __init__(self):
            self.go, self.flag, self.out = torch.tensor(True), torch.tensor(False), torch.zeros(2)
            self.logits = None

        def run(self, ex):
            self.out[0] += 1
            self.flag.copy_(self.go)
            ex.when(self.flag, lambda: self.out[1].add_(2))
            self.logits = self.out.clone()

    program = Program()
    graph = StepReplayedOnCPU(program)  # captured with every body taken
    assert program.out.tolist() == [1, 2]
    program.go.fill_(False)  # changed after the capture: read at replay
    graph.replay()
    assert program.out.tolist() == [2, 2] and graph.output.tolist() == [2, 2]  # body skipped, its buffer as it was
    program.go.fill_(True)
    graph.replay()
    assert program.out.tolist() == [3, 4]
    assert Conditional().when(torch.tensor(False), lambda: pytest.fail("a false predicate runs no body")) is False
    assert Always().when(torch.tensor(False), lambda: None) is True


def test_a_forced_graph_path_where_it_cannot_run_names_what_is_available(model):
    for name in ("compiled-if", "compiled-lookahead"):
        with pytest.raises(ValueError, match=rf"decode.engine '{name}' needs CUDA graphs.*available here: auto, "
                                             r"eager, compiled$"):
            resolve_engine(name, "cpu")
        with pytest.raises(ValueError, match="available here"):
            with_engine(LayerStack(model), name)
    with pytest.raises(ValueError, match="decode.engine must be one of auto, eager, compiled, compiled-if, "
                                         "compiled-lookahead; got 'graphs'"):
        resolve_engine("graphs", "cpu")


def test_a_timed_block_that_would_compile_or_capture_fails(graphed, profile):
    """C2's timed blocks build nothing: here the warm-up (told the engine does not compile) leaves a larger slab's
    step for the timed blocks to capture, and the block fails naming what it built."""
    from emad.evaluation.speed import CompiledWhileTimedError, time_prompts

    view = copy.copy(graphed)
    view.compiles_shapes = False  # warm up as an eager engine would: the first prompt, two tokens
    prompts = [random_prompts(1, [5], seed=1)[0], *random_prompts(7, [150], seed=2)]  # > 128 slots: a new slab
    with pytest.raises(CompiledWhileTimedError, match=r"timed block on prompt 1 compiled \d+ function\(s\) and "
                                                      r"captured [1-9]\d* graph\(s\)"):
        time_prompts(view, TOK, [Method(Emad(profile, 0.0), "monotone", TopK(48))], prompts, 4)
    timed = time_prompts(graphed, TOK, [Method(Emad(profile, 0.0), "monotone", TopK(48))], prompts, 4)
    assert len(timed[0]["speed_pairs"]) == 8 and timed[0]["decode_speedup"] is not None  # built first: it times


def test_speed_tokens_by_device_are_checked():
    from emad.evaluation.config import DecodeConfig

    domains = {"domains": {"d": ["perplexity", "fidelity"]}, "tasks": {"fidelity": {"prompts": 16}}}
    cfg = DecodeConfig(**domains, speed_tokens_by_device={"cuda": 64})
    assert cfg.speed_tokens_by_device == {"cuda": 64}
    with pytest.raises(ValueError, match=r"speed_tokens_by_device: 'gpu' is not a device type \(cpu, cuda"):
        DecodeConfig(**domains, speed_tokens_by_device={"gpu": 64})
    with pytest.raises(ValueError, match=r"speed_tokens_by_device.cuda = 1: a timed generation needs at least 2"):
        DecodeConfig(**domains, speed_tokens_by_device={"cuda": 1})


# ------------------------------------------------------------------------------------------ fallbacks that say so


class FailingIfCapture:
    """A capture with conditional nodes that fails, as it does where the driver lacks them."""

    def __init__(self, program):
        raise RuntimeError("CUDA error: operation not supported on this driver (a test's IF capture)")


def test_a_failed_if_capture_falls_back_to_lookahead_and_says_why(profile):
    from emad.engine.engines import compile_stats

    stack = as_on_cuda(LayerStack(tiny_model("llama")), BACKEND, "if")
    stack.runner.capture_step = FailingIfCapture
    prompts = random_prompts(4, [5, 9, 7, 12], seed=3)
    method = lambda: Method(Emad(profile, 0.0), "monotone", TopK(48))  # noqa: E731
    with pytest.warns(RuntimeWarning, match="capture with conditional IF nodes failed"):
        out = generate(stack, TOK, prompts, method(), NEW)
    assert out.step_path == "device/graph-lookahead"
    assert out.token_ids == generate(LayerStack(stack.model), TOK, prompts, method(), NEW).token_ids
    fallbacks = compile_stats(stack)["graph_fallbacks"]
    assert len(fallbacks) == 1 and "operation not supported on this driver" in fallbacks[0]
    assert generate(stack, TOK, prompts, Method(Full()), NEW).step_path == "device/graph-lookahead"  # not retried


def test_a_step_without_graphs_where_graphs_were_expected_says_so(profile):
    from emad.engine.engines import compile_stats

    stack = as_on_cuda(LayerStack(tiny_model("llama")), BACKEND, "if")
    held = stack.new_cache(2, 20)  # the runner's slab of 2 x 128 is lent: a generation of that shape gets its own
    with pytest.warns(RuntimeWarning, match="without graphs .* slab of 2 rows x 128 slots is lent"):
        out = generate(stack, TOK, random_prompts(2, [5, 9], seed=3), Method(Full()), NEW)
    assert out.step_path == "device/immediate" and held.slab.lent_to() is held
    assert any("is lent to another cache" in r for r in compile_stats(stack)["graph_fallbacks"])


def test_probes_of_one_shape_share_one_compiled_settling_and_methods_share_what_they_can(profile):
    """One compiled function per structure: segments by their number of layers (here all of one layer), a probe's
    settling by its shape (first, middle, last: probes 2 and 3 share the middle one), reset and finish by the probe
    count. A method of another kind adds only its estimated probes' settlings (the last probe, not estimated, is the
    same for every method)."""
    stack = as_on_cuda(LayerStack(tiny_model("llama")), BACKEND, "if")
    prompts = random_prompts(2, [5, 9], seed=3)
    generate(stack, TOK, prompts, Method(Confidence(3.0, probe_every=1)), NEW)
    kinds = [layout[0] for layout in stack.runner.stats.layouts]
    assert sorted(kinds) == ["begin", "finish", "segment", "settle", "settle", "settle"]
    generate(stack, TOK, prompts, Method(Emad(profile, 0.0), "monotone", TopK(48)), NEW)
    kinds = [layout[0] for layout in stack.runner.stats.layouts]
    assert kinds.count("settle") == 5 and len(kinds) == 8
