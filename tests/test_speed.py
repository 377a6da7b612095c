"""C2's timing: one pair per distinct prompt after an untimed warm-up, each side first on half of the prompts (points
timed together share full depth's generation of each prompt), the interval over prompts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from emad.evaluation import speed
from emad.evaluation.intervals import ratio_interval
from emad.evaluation.units import CONFIRMATION, indices
from emad.exits.criteria import Full

PROMPTS = [[i, i + 1] for i in range(8)]
NEW = 10


def _stub(monkeypatch, seconds_of):
    """``generate`` replaced by a stub whose time is ``seconds_of(prompt index, is_full)``; returns the calls."""
    calls = []

    def generate(stack, tokenizer, prompts, method, new_tokens):
        (prompt,) = prompts
        is_full = isinstance(method, Full)
        calls.append((PROMPTS.index(prompt), "full" if is_full else "method"))
        return SimpleNamespace(token_ids=[[0] * new_tokens], seconds=seconds_of(PROMPTS.index(prompt), is_full),
                               prefill_seconds=0.0)

    monkeypatch.setattr(speed, "generate", generate)
    return calls


def test_one_pair_per_prompt_after_a_warm_up_each_side_first_on_half(monkeypatch):
    calls = _stub(monkeypatch, lambda i, full: 1.0 if full else 0.8)
    out = speed.time_prompts(None, None, [object()], PROMPTS, NEW)[0]
    assert calls[:2] == [(0, "method"), (0, "full")]  # the warm-up: one generation of each, not a pair
    pairs = calls[2:]
    assert len(pairs) == 16 and len(out["speed_pairs"]) == 8 and out["speed_unit"] == "prompt"
    firsts = [pairs[2 * i][1] for i in range(8)]
    assert firsts.count("method") == 4 and firsts.count("full") == 4
    assert [pairs[2 * i][0] for i in range(8)] == list(range(8)) == [pairs[2 * i + 1][0] for i in range(8)]
    assert out["speedup"] == pytest.approx(1.25)


def test_points_timed_together_share_one_full_depth_generation_per_prompt_in_turning_order(monkeypatch):
    """A block of two points: per prompt, full depth once and each point once, the order reversed from prompt to
    prompt and turning every two; each point's pair holds full depth's generation of the same block."""
    a, b = object(), object()
    calls = []

    def generate(stack, tokenizer, prompts, method, new_tokens):
        (prompt,) = prompts
        who = "full" if isinstance(method, Full) else "a" if method is a else "b"
        calls.append((PROMPTS.index(prompt), who))
        i = PROMPTS.index(prompt)
        seconds = {"full": 1.0 + 0.1 * i, "a": 0.5, "b": 2.0}[who]
        return SimpleNamespace(token_ids=[[0] * new_tokens], seconds=seconds, prefill_seconds=0.0)

    monkeypatch.setattr(speed, "generate", generate)
    out_a, out_b = speed.time_prompts(None, None, [a, b], PROMPTS, NEW)
    assert calls[:3] == [(0, "a"), (0, "b"), (0, "full")]  # the warm-up: one generation of each
    blocks = [calls[3 + 3 * i: 6 + 3 * i] for i in range(8)]
    assert len(calls) == 3 + 3 * 8 and all(sorted(w for _, w in blk) == ["a", "b", "full"] for blk in blocks)
    assert [blk[0][1] for blk in blocks] == ["a", "full", "b", "a", "full", "b", "a", "full"]  # each first in turn
    for point in ("a", "b"):  # balanced per point: before full depth on half the prompts
        assert sum([w for _, w in blk].index(point) < [w for _, w in blk].index("full") for blk in blocks) == 4
    assert all({p for p, _ in blk} == {i} for i, blk in enumerate(blocks))
    full_tps = [NEW / (1.0 + 0.1 * i) for i in range(8)]
    assert [b_ for _, b_ in out_a["speed_pairs"]] == pytest.approx(full_tps)
    assert [b_ for _, b_ in out_b["speed_pairs"]] == pytest.approx(full_tps)
    assert out_a["speed_block"] == out_b["speed_block"] == 2
    assert out_b["speedup"] < 1 < out_a["speedup"]


def test_the_interval_is_over_prompts_and_widens_with_a_slow_prompt(monkeypatch):
    def even(i, full):
        return 1.0 if full else 0.8 * (1 + 0.01 * (i % 3))

    def one_slow(i, full):  # prompt 5: the method gains nothing there
        return 1.0 if full else (1.0 if i == 5 else even(i, full))

    _stub(monkeypatch, even)
    steady = ratio_interval([a / b for a, b in speed.time_prompts(None, None, [object()], PROMPTS, NEW)[0]["speed_pairs"]])
    _stub(monkeypatch, one_slow)
    out = speed.time_prompts(None, None, [object()], PROMPTS, NEW)[0]
    ratios = [a / b for a, b in out["speed_pairs"]]
    assert ratios[5] == pytest.approx(1.0) and min(ratios[:5] + ratios[6:]) > 1.2
    wide = ratio_interval(ratios)
    assert wide.n == 8 and wide.hi - wide.lo > 3 * (steady.hi - steady.lo) and wide.lo < steady.lo


def test_fewer_speed_prompts_than_asked_is_an_error_naming_both(monkeypatch):
    _stub(monkeypatch, lambda i, full: 1.0)
    task = SimpleNamespace(speed_prompts=lambda data, settings: (PROMPTS[:8], NEW))
    prepared = [SimpleNamespace(name="fidelity", task=task, data=None, settings=None)]
    with pytest.raises(ValueError, match=r"speed_prompts = 8, but task 'fidelity' has only 4 prompts in the "
                                         r"confirmation half \(8 in all.*at least 16"):
        speed.speed_prompts_of(prepared, SimpleNamespace(generated={}), 8)


def test_c2_times_prompts_of_the_confirmation_half_only():
    prompts = [[i] for i in range(32)]
    task = SimpleNamespace(speed_prompts=lambda data, settings: (prompts, NEW))
    prepared = [SimpleNamespace(name="fidelity", task=task, data=None, settings=None)]
    for seed in (0, 1):
        timed = speed.speed_prompts_of(prepared, SimpleNamespace(generated={}), 8, seed)
        assert [p[0] for p in timed] == indices(32, CONFIRMATION, seed, "fidelity")[:8]


def test_the_cheap_measure_sets_the_task_generation_against_a_reference_made_once(monkeypatch):
    """The figures' measure: the point's first sample is the generation its task made, set against full depth's
    reference tokens/s on the same prompts (the median of a few generations, made once per prompt set); further
    repeats alternate fresh generations of both."""
    calls = []

    def generate(stack, tokenizer, prompts, method, new_tokens):
        is_full = isinstance(method, Full)
        calls.append("full" if is_full else "method")
        return SimpleNamespace(token_ids=[[0] * new_tokens] * len(prompts),
                               seconds=(1.0 if is_full else 0.5) * (1 + 0.1 * (len(calls) % 3)))

    monkeypatch.setattr(speed, "generate", generate)
    assert speed.reference_speed(None, None, PROMPTS, NEW) == pytest.approx(80 / 1.1)  # median of 3: 1.2, 1.0, 1.1 s
    assert calls == ["full"] * speed.REFERENCE_RUNS
    made = SimpleNamespace(token_ids=[[0] * NEW] * 8, seconds=0.4, timed=True)
    task = SimpleNamespace(speed_prompts=lambda data, settings: (PROMPTS, NEW))
    prepared = [SimpleNamespace(name="fidelity", task=task, data=None, settings=None)]
    asked = []

    def reference(prompts, tokens):
        asked.append((len(prompts), tokens))
        return 40.0

    calls.clear()
    out = speed.point_speedup(None, None, object(), prepared, SimpleNamespace(generated={"fidelity": [made]}), None,
                              1, reference=reference)
    assert calls == [] and asked == [(8, NEW)]  # nothing generated: the task's generation and the reference
    assert out["speed_pairs"] == [[200.0, 40.0]] and out["speedup"] == pytest.approx(5.0)
    out = speed.point_speedup(None, None, object(), prepared, SimpleNamespace(generated={"fidelity": [made]}), None,
                              2, reference=reference)
    assert calls == ["full", "method"] and len(out["speed_pairs"]) == 2  # the second repeat: full depth first
    # a task generation that reused its batch's prompt pass is no timing: the first prompt is generated afresh
    calls.clear(), asked.clear()
    reused = SimpleNamespace(token_ids=[[0] * NEW] * 8, seconds=0.01, timed=False)
    out = speed.point_speedup(None, None, object(), prepared, SimpleNamespace(generated={"fidelity": [reused]}),
                              None, 1, reference=reference)
    assert calls == ["method"] and asked == [(1, NEW)]
    assert out["speed_pairs"] == [[NEW / 0.55, 40.0]] and out["speedup"] == pytest.approx(NEW / 0.55 / 40)


def test_on_a_gpu_the_faster_of_our_full_depth_and_hf_static_generate_is_the_reference(monkeypatch):
    """Where HF's static-cache generate compiles (CUDA), it is timed in every block beside our full depth; the faster
    of the two is C2's reference, and each point's speed-up against both is kept."""
    calls = _stub(monkeypatch, lambda i, full: 1.0 if full else 0.5)
    hf = []

    def hf_static(stack, tokenizer, prompt, new_tokens):
        hf.append((PROMPTS.index(prompt), new_tokens))
        return new_tokens / 0.25  # four times our full depth's speed

    monkeypatch.setattr(speed, "hf_static_generate", hf_static)
    monkeypatch.setattr(speed, "gpu_of", lambda device: "Some GPU, 80 GiB")
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    out = speed.time_prompts(gpu, None, [object()], PROMPTS, NEW)[0]
    assert out["speed_device"] == "cuda: Some GPU, 80 GiB"  # the GPU, not the host's CPU
    assert hf[0] == (PROMPTS.index(max(PROMPTS, key=len)), NEW)  # warmed up on the longest prompt, all tokens
    assert [p for p, _ in hf[1:]] == list(range(8)) and len(calls) == 2 + 16
    assert out["speed_reference"] == speed.HF_STATIC
    assert out["speedup"] == pytest.approx(0.5) and out["reference_tokens_per_s"] == pytest.approx(NEW / 0.25)
    assert out["speedup_by_reference"] == pytest.approx({speed.FULL_DEPTH: 2.0, speed.HF_STATIC: 0.5})
    assert [b for _, b in out["speed_pairs"]] == pytest.approx([NEW / 0.25] * 8)
    cpu = speed.time_prompts(SimpleNamespace(device=SimpleNamespace(type="cpu")), None, [object()], PROMPTS, NEW)[0]
    assert cpu["speed_reference"] == speed.FULL_DEPTH and set(cpu["speedup_by_reference"]) == {speed.FULL_DEPTH}


def test_hf_static_generate_runs_and_counts_the_tokens_our_full_depth_makes():
    from emad.decode import generate
    from emad.engine.stack import LayerStack
    from tests.tiny import TinyTokenizer, tiny_model

    stack = LayerStack(tiny_model("llama"))
    prompt = [5, 7, 9, 11]
    assert speed.hf_static_generate(stack, TinyTokenizer(), prompt, 6) > 0
    ours = generate(stack, TinyTokenizer(), [prompt], Full(), 6)
    hf = stack.model.generate(__import__("torch").tensor([prompt]), max_new_tokens=6, do_sample=False,
                              cache_implementation="static", pad_token_id=0)
    assert hf[0, len(prompt):].tolist() == ours.token_ids[0]


def _host_cpu() -> str:
    """The host's CPU model as /proc/cpuinfo names it (platform's answer elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def test_every_speed_record_names_the_device_its_pairs_were_timed_on():
    """On a tiny model on this host's CPU: C2's timing, the cheap measure and the no-prompt records of both name
    ``cpu: <this CPU's model>``."""
    from emad.engine.stack import LayerStack
    from tests.tiny import TinyTokenizer, tiny_model

    stack, tok = LayerStack(tiny_model("llama")), TinyTokenizer()
    host = f"cpu: {_host_cpu()}"
    assert stack.device.type == "cpu" and len(host) > len("cpu: ")
    timed = speed.time_prompts(stack, tok, [Full()], PROMPTS, 3)
    assert len(timed[0]["speed_pairs"]) == 8 and timed[0]["speed_device"] == host
    cheap = speed.measure_speedup(stack, tok, Full(), PROMPTS[:2], 3, 2)
    assert len(cheap["speed_pairs"]) == 2 and cheap["speed_device"] == host
    assert speed.time_prompts(stack, tok, [Full()], [], 3)[0]["speed_device"] == host
    assert speed.measure_speedup(stack, tok, Full(), [], 0, 0)["speed_device"] == host
    none = SimpleNamespace(speed_prompts=lambda data, settings: None)
    prepared = [SimpleNamespace(name="fidelity", task=none, data=None, settings=None)]
    assert speed.point_speedup(stack, tok, Full(), prepared, SimpleNamespace(generated={}), None, 1)[
        "speed_device"] == host


def test_the_verdict_names_the_speed_reference_and_the_speed_up_against_each_decoder_timed():
    from emad.evaluation.judge import PointAssessment, _references
    from emad.report.verdict import speed_text

    runs = [{"cost": {"speed_reference": speed.HF_STATIC,
                      "speedup_by_reference": {speed.FULL_DEPTH: 2.0, speed.HF_STATIC: 0.5}}}]
    reference, by_ref = _references(runs)
    point = PointAssessment("p", "p", None, "fixed", ["d"], ["r"], [], 0.5, 0.5,
                            speed=ratio_interval([0.5] * 8), speed_reference=reference, speedup_by_reference=by_ref)
    text = speed_text(point)
    assert text.startswith(f"0.50× vs {speed.HF_STATIC} (95% CI 0.50 to 0.50, 8 prompts")
    assert f"vs {speed.FULL_DEPTH} 2.00×" in text


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("n", [8, 9, 16])
def test_every_point_runs_before_every_reference_on_half_its_prompts(size, n):
    """C2's design: in blocks of any size, each generation runs before each other on ⌊n/2⌋ or ⌈n/2⌉ of n prompts
    (with a block of three — reference, fixed, EMAD — turning alone gave EMAD 3 of 8 and fixed 6 of 8)."""
    orders = [speed.block_order(i, size) for i in range(n)]
    assert all(sorted(o) == list(range(size)) for o in orders)
    for x in range(size):
        for y in range(size):
            if x != y:
                assert sum(o.index(x) < o.index(y) for o in orders) in (n // 2, (n + 1) // 2)
    assert {o[0] for o in orders} == set(range(size))  # every generation also leads some block


def test_on_a_compiled_engine_every_generation_warms_up_on_the_longest_prompt_with_all_its_tokens(monkeypatch):
    """A compiled engine compiles per shape: warmed up on the largest one, every timed prompt reuses it."""
    seen = []

    def generate(stack, tokenizer, prompts, method, new_tokens):
        seen.append((PROMPTS.index(prompts[0]) if prompts[0] in PROMPTS else -1, new_tokens))
        return SimpleNamespace(token_ids=[[0] * new_tokens], seconds=1.0, prefill_seconds=0.0)

    built = []
    monkeypatch.setattr(speed, "generate", generate)
    monkeypatch.setattr(speed, "build", lambda stack, method, batch, capacity: built.append((method, batch, capacity)))
    prompts = [*PROMPTS[:7], [1, 2, 3, 4, 5]]  # the last is the longest
    compiled = SimpleNamespace(device=SimpleNamespace(type="cpu"), compiles_shapes=True)
    method = object()
    speed.time_prompts(compiled, None, [method], prompts, NEW)
    assert [(m is method or type(m).__name__, b, c) for m, b, c in built] == [(True, 1, 5 + NEW), ("Full", 1, 5 + NEW)]
    assert seen[:2] == [(-1, NEW), (-1, NEW)]  # method and full depth: the longest prompt, all tokens
