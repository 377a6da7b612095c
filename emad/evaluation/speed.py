"""A point's speed-up, timed where it runs, against full-depth generations of the same prompts in the same process.

Two measures:

- :func:`time_prompts` (C2): the unit of a speed-up is a distinct prompt — an adaptive method's speed-up is
  what varies between inputs. Each of ``n`` prompts is one timed block (full depth and the points being timed
  together, back to back, the order turning from prompt to prompt), after one untimed warm-up generation of each;
  a point's pairs with full depth's generation in the same block (``speed_pairs``) give the verdict's 95% interval
  over prompts. The verdict reads at least ``MIN_SPEED_PROMPTS`` per domain.
- :func:`measure_speedup` (the figures' cheap measure, for points the verdict does not time): the point's
  tokens/s over full depth's on the same prompts — its first sample the generation its task just made (or, when
  that generation shared its batch's prompt pass, a fresh generation of the first prompt), against a full-depth
  reference made once per prompt set in the same process (:func:`reference_speed`: the median of
  :data:`REFERENCE_RUNS` generations), further repeats alternating fresh generations of both.

Timing each point against a full-depth run made in another process (at another time, under another load) turns a
busy machine into a fake slow-down; pairing them in time cancels most of it. The load average around the
measurement is recorded beside it, and the device it was made on (:func:`speed_device`): the verdict pools pairs of
one device only (:mod:`emad.evaluation.speed_devices`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from emad.decode import Generation, generate
from emad.decode.step import elapsed
from emad.decode.steppers import build
from emad.engine.engines import compile_stats
from emad.evaluation.provenance import cpu_model, gpu_of
from emad.evaluation.speed_devices import device_name
from emad.evaluation.units import CONFIRMATION, Units
from emad.exits.criteria import Full


def speed_device(stack) -> str:
    """The device ``stack`` generates on, as a speed record names it (``speed_device``,
    :func:`~emad.evaluation.speed_devices.device_name`): ``cuda: NVIDIA H200, 139 GiB`` on a GPU, else
    ``<device type>: <CPU model>``; the host's CPU for a stack without a device."""
    device = getattr(stack, "device", None)
    kind = getattr(device, "type", None) or "cpu"
    return device_name(kind, gpu_of(device) if kind == "cuda" else None, cpu_model())


def _tokens_per_s(out: Generation) -> float:
    return sum(len(row) for row in out.token_ids) / max(out.seconds, 1e-9)


def _decode_tokens_per_s(out: Generation) -> float | None:
    """Tokens/s of the decode steps alone: the tokens after each row's first over the time after the prompts' pass
    and first token (None for a generation that does not split its time, e.g. a strategy's)."""
    steps = sum(max(len(row) - 1, 0) for row in out.token_ids)
    decoding = out.seconds - out.prefill_seconds
    return steps / decoding if out.prefill_seconds and steps and decoding > 0 else None


class CompiledWhileTimedError(RuntimeError):
    """A timed block compiled a function or captured a graph: its time would include building the engine."""


def _built(stack) -> tuple[int, int]:
    """Functions compiled and graphs captured so far on ``stack``'s model (0, 0 on an eager stack)."""
    stats = compile_stats(stack)
    return stats.get("compilations", 0), stats.get("graphs", 0)


def _speed_prompts(prepared: Sequence, result) -> tuple | None:
    """``(prepared task, (prompts, new tokens))`` of the first task with speed prompts, preferring one whose
    generation ``result`` just made (fidelity); None when no task has any."""
    found = [(p, p.task.speed_prompts(p.data, p.settings)) for p in prepared]
    found = sorted([(p, f) for p, f in found if f], key=lambda pf: not result.generated.get(pf[0].name))
    return found[0] if found else None


WARM_UP_TOKENS = 2  # new tokens of a warm-up generation: its prompt pass and steps run every code path once


def speed_prompts_of(prepared: Sequence, result, prompts: int, seed: int = 0) -> list | None:
    """C2's prompts of a point: the first ``prompts`` speed prompts of the confirmation half (under the split's
    ``seed``, :mod:`emad.evaluation.units`) of its first task that has them (:func:`point_speedup` for how it is
    found) — the half the verdict judges, so that no timed prompt was one the screen chose on; None when no task has
    any.

    Raises:
        ValueError: the task's confirmation half has fewer speed prompts than ``prompts`` (names both counts).
    """
    found = _speed_prompts(prepared, result)
    if found is None:
        return None
    p, (have, _) = found
    judged = Units(CONFIRMATION, seed).take(p.name, have)
    if len(judged) < prompts:
        raise ValueError(f"decode.speed_prompts = {prompts}, but task {p.name!r} has only {len(judged)} prompts in "
                         f"the confirmation half ({len(have)} in all; C2 times that half): raise "
                         f"decode.tasks.{p.name}.prompts to at least {2 * prompts}")
    return [list(x) for x in judged[:prompts]]


FULL_DEPTH = "emad full depth"  # our own full-depth generation: the reference on every device
HF_STATIC = "HF generate, static cache"  # the fastest full-depth decoder a user already has where it compiles
# Device types where HF's static-cache ``generate`` compiles its step (torch.compile, CUDA graphs) and so is the
# full-depth decoder to beat; on a CPU it runs eagerly, and our full depth stays the reference.
HF_STATIC_DEVICES = ("cuda",)


def hf_static_generate(stack, tokenizer, prompt: Sequence[int], new_tokens: int) -> float:
    """Tokens/s of HF ``generate`` with a static cache on one prompt: greedy, up to ``new_tokens``, stopping at the
    model's EOS as our generation does (at full depth both make the same tokens)."""
    import torch

    ids = torch.tensor([list(prompt)], device=stack.device)
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    began = time.perf_counter()
    out = stack.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               do_sample=False, cache_implementation="static", pad_token_id=pad)
    seconds = elapsed(stack.device, began)
    return (out.shape[1] - ids.shape[1]) / max(seconds, 1e-9)


def full_depth_references(stack) -> dict[str, Callable]:
    """The full-depth decoders C2 is timed against on ``stack``'s device, by name: ``(stack, tokenizer, prompt,
    new_tokens) -> (tokens/s, decode-only tokens/s or None)``. Our full depth always; HF's static-cache ``generate``
    on :data:`HF_STATIC_DEVICES` (whose time does not split its prompt's pass from its steps)."""
    refs = {FULL_DEPTH: lambda st, tok, prompt, new: _rates(generate(st, tok, [list(prompt)], Full(), new))}
    device = getattr(getattr(stack, "device", None), "type", None)
    if device in HF_STATIC_DEVICES:
        refs[HF_STATIC] = lambda st, tok, prompt, new: (hf_static_generate(st, tok, prompt, new), None)
    return refs


def _rates(out: Generation) -> tuple[float, float | None]:
    return _tokens_per_s(out), _decode_tokens_per_s(out)


SPEED_BASIS = "whole generation (the prompt's pass included)"  # what C2's speed-up divides


def time_prompts(stack, tokenizer, methods: Sequence, prompts: Sequence[Sequence[int]],
                 new_tokens: int) -> list[dict[str, Any]]:
    """C2's timing of ``methods`` on the same prompts: one timed block per prompt, in which the full-depth
    references (:func:`full_depth_references`) and each method generate ``new_tokens`` from it back to back, after
    one untimed warm-up generation of each (:data:`WARM_UP_TOKENS` new tokens on the first prompt; an HF reference,
    and every generation on a compiled engine, warms up on the longest prompt with all its tokens, so that its
    static cache and compiled steps serve every prompt). On a compiled engine every piece a method can run at that
    size is built before the warm-up (:func:`~emad.decode.steppers.build`), and a block that still compiles or
    captures anything fails (:class:`CompiledWhileTimedError`): its time would include building the engine.
    The order within a block (:func:`block_order`) is reversed from one prompt to the next and turns by one every
    two prompts, so that each point runs before each reference on half of its prompts.

    The speed reference is the faster full-depth decoder (the higher median tokens/s over the prompts); a method's
    pair on a prompt is its tokens/s and the reference's in the same block. Speed-ups divide whole generations
    (:data:`SPEED_BASIS`); the decode steps' own speed-up against our full depth is reported beside them.

    Returns:
        Per method: ``speedup`` (geometric mean of the per-prompt ratios method tokens/s ÷ reference tokens/s), the
        medians ``speed_tokens_per_s`` and ``reference_tokens_per_s``, ``speed_reference`` (which decoder),
        ``speed_pairs`` (per prompt ``[method tokens/s, reference tokens/s]``), ``speedup_by_reference`` and
        ``reference_tokens_per_s_by_reference`` (every reference timed), ``decode_speedup`` and
        ``decode_speed_pairs`` (the decode steps alone, against our full depth's; None where not split),
        ``speed_basis``, ``speed_unit`` (``prompt``), ``speed_block`` (the methods timed in the blocks),
        ``speed_new_tokens``, ``load_avg`` (1-minute load average, the larger of before and after) and
        ``speed_device`` (where the pairs were timed, :func:`speed_device`). Values are None without prompts (the
        device is named even then).
    """
    device = speed_device(stack)
    if not prompts:
        return [{"speedup": None, "speed_tokens_per_s": None, "reference_tokens_per_s": None, "speed_pairs": [],
                 "speed_reference": None, "speed_unit": "prompt", "speed_block": len(methods),
                 "speed_new_tokens": None, "load_avg": None, "speed_device": device} for _ in methods]
    before = os.getloadavg()[0]
    refs = full_depth_references(stack)
    runs = [lambda prompt, new, m=m: _rates(generate(stack, tokenizer, [list(prompt)], m, new)) for m in methods]
    runs += [lambda prompt, new, f=f: f(stack, tokenizer, prompt, new) for f in refs.values()]  # references last
    longest = max(prompts, key=len)
    compiles = getattr(stack, "compiles_shapes", False)
    for method in [*methods, Full()] if compiles else []:  # every segment, probe and graph, before any timing
        build(stack, method, 1, len(longest) + new_tokens)
    for j, run in enumerate(runs):  # warm-up: caches, allocator, lazy initialisation, compilation — not timed
        hf = j >= len(methods) and list(refs)[j - len(methods)] != FULL_DEPTH
        if hf or compiles:  # compiled once for the largest shape, every prompt fits
            run(longest, new_tokens)
        else:
            run(prompts[0], min(new_tokens, WARM_UP_TOKENS))
    built = _built(stack)
    rates: list[list[tuple]] = [[] for _ in runs]  # per run, per prompt: (tokens/s, decode-only tokens/s)
    for i, prompt in enumerate(prompts):
        for j in block_order(i, len(runs)):
            rates[j].append(runs[j](prompt, new_tokens))
        if _built(stack) != built:
            made = [a - b for a, b in zip(_built(stack), built)]
            raise CompiledWhileTimedError(
                f"C2's timed block on prompt {i} compiled {made[0]} function(s) and captured {made[1]} graph(s) that "
                f"the warm-up did not build ({', '.join(_name(m) for m in methods)}): its time would include building "
                f"the engine; run these points with decode.engine: eager, or report this as a bug")
    load = max(before, os.getloadavg()[0])
    tps = [[r[0] for r in run] for run in rates]
    by_ref = dict(zip(refs, tps[len(methods):]))
    best = max(by_ref, key=lambda name: statistics.median(by_ref[name]))
    ours = [r[1] for r in rates[len(methods) + list(refs).index(FULL_DEPTH)]]
    out = []
    for own, own_rates in zip(tps[: len(methods)], rates[: len(methods)]):
        speedups = {name: _geometric_mean([a / b for a, b in zip(own, ref)]) for name, ref in by_ref.items()}
        decode = [[r[1], f] for r, f in zip(own_rates, ours)]
        split = all(a is not None and b is not None for a, b in decode)
        out.append({"speedup": speedups[best], "speed_tokens_per_s": statistics.median(own),
                    "reference_tokens_per_s": statistics.median(by_ref[best]), "speed_reference": best,
                    "speed_pairs": [[a, b] for a, b in zip(own, by_ref[best])],
                    "speedup_by_reference": speedups,
                    "reference_tokens_per_s_by_reference": {n: statistics.median(r) for n, r in by_ref.items()},
                    "decode_speedup": _geometric_mean([a / b for a, b in decode]) if split else None,
                    "decode_speed_pairs": decode if split else [], "speed_basis": SPEED_BASIS,
                    "speed_unit": "prompt", "speed_block": len(methods), "speed_new_tokens": new_tokens,
                    "load_avg": load, "speed_device": device})
    return out


def block_order(i: int, size: int) -> list[int]:
    """The order of a timed block's ``size`` generations on prompt ``i``: on prompts 2k and 2k + 1 one order and its
    reverse, the order turning by one from pair to pair. Each generation runs before each other on half the
    prompts (⌊n/2⌋ or ⌈n/2⌉ of n): every point before every reference equally often, whatever the block's size."""
    turn = (i // 2) % size
    order = [*range(turn, size), *range(turn)]
    return order[::-1] if i % 2 else order


def _name(method) -> str:
    describe = getattr(method, "describe", None)
    return str(describe().get("method", method)) if describe else str(method)


def _geometric_mean(ratios: Sequence[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


REFERENCE_RUNS = 3  # full-depth generations whose median tokens/s is a prompt set's cheap-measure reference


def reference_speed(stack, tokenizer, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
    """Full depth's tokens/s on ``prompts``: the median of :data:`REFERENCE_RUNS` generations of ``new_tokens``."""
    full = Full()
    return statistics.median(_tokens_per_s(generate(stack, tokenizer, [list(p) for p in prompts], full, new_tokens))
                             for _ in range(REFERENCE_RUNS))


def point_speedup(stack, tokenizer, method, prepared: Sequence, result, limit: int | None,
                  repeats: int, new_tokens: int | None = None,
                  reference: Callable[[Sequence[Sequence[int]], int], float] | None = None) -> dict[str, Any]:
    """:func:`measure_speedup` of a point on the speed prompts of its first task that has them (first ``limit``),
    preferring a task whose generation of them ``result`` (an :class:`~emad.evaluation.evaluate.Evaluation`) just
    made (fidelity): that generation is then the first sample, set against ``reference(prompts, new tokens)`` (full
    depth's tokens/s on them, e.g. a cached :func:`reference_speed`) when given. ``new_tokens``: generate that many
    instead of the task's own count (the generation already made is then not reused). A task generation that
    shared its prompts' pass (:class:`~emad.decode.Prefills`, batches of prompts) is not timed: the first prompt is
    then generated afresh and set against the reference on it. No prompts: nothing measured. Every result names
    its ``speed_device``, as :func:`measure_speedup`'s does."""
    found = _speed_prompts(prepared, result)
    if found is None:
        return measure_speedup(stack, tokenizer, method, [], 0, 0)
    p, (prompts, own_tokens) = found
    prompts, tokens = prompts[:limit], new_tokens or own_tokens
    made = None if new_tokens else next((g for g in result.generated.get(p.name, [])
                                         if len(g.token_ids) == len(prompts)), None)
    if made is not None and not made.timed:  # its batch shared a prompt pass: the first prompt is generated afresh
        prompts = prompts[:1]
    ref = reference(prompts, tokens) if reference is not None and made is not None else None
    return measure_speedup(stack, tokenizer, method, prompts, tokens, repeats, made if made and made.timed else None,
                           ref)


def measure_speedup(stack, tokenizer, method, prompts: Sequence[Sequence[int]], new_tokens: int,
                    repeats: int, made: Generation | None = None, reference: float | None = None) -> dict[str, Any]:
    """Generate ``prompts`` ``repeats`` times under ``method`` and at full depth, alternating which goes first.

    ``made``: the method's generation of these prompts that was just timed (e.g. by the fidelity task): it is the
    first repeat's own sample, followed by a full-depth generation, so that it is not made again — or, given
    ``reference`` (full depth's tokens/s on these prompts, :func:`reference_speed`), set against that.

    Returns:
        ``speedup`` (median of the per-repeat ratios method tokens/s ÷ full-depth tokens/s), the medians
        ``speed_tokens_per_s`` and ``reference_tokens_per_s``, ``speed_repeats``, ``speed_pairs`` (per repeat,
        ``[method tokens/s, full-depth tokens/s]``), ``speed_unit`` (``repeat``), ``speed_new_tokens``, ``load_avg``
        (1-minute load average, the larger of before and after) and ``speed_device`` (:func:`speed_device`).
        Values are None when ``repeats`` is 0 or there are no prompts (the device is named even then).
    """
    device = speed_device(stack)
    if repeats == 0 or not prompts:
        return {"speedup": None, "speed_tokens_per_s": None, "reference_tokens_per_s": None, "speed_repeats": 0,
                "speed_pairs": [], "speed_unit": "repeat", "speed_new_tokens": None, "load_avg": None,
                "speed_device": device}
    before = os.getloadavg()[0]
    own, ref = [], []
    full = Full()
    first = made is not None  # the method went first in repeat 0
    for r in range(repeats):
        for m in ((method, full) if (r % 2 == 0) == first else (full, method)):
            if m is full and r == 0 and reference is not None:
                ref.append(reference)
                continue
            out = made if (m is method and r == 0 and first) else generate(stack, tokenizer, prompts, m, new_tokens)
            (ref if m is full else own).append(_tokens_per_s(out))
    return {"speedup": statistics.median(a / b for a, b in zip(own, ref)),
            "speed_tokens_per_s": statistics.median(own), "reference_tokens_per_s": statistics.median(ref),
            "speed_repeats": repeats, "speed_pairs": [[a, b] for a, b in zip(own, ref)], "speed_unit": "repeat",
            "speed_new_tokens": new_tokens, "load_avg": max(before, os.getloadavg()[0]), "speed_device": device}
