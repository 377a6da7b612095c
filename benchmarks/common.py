"""Shared helpers for benchmark scripts: device sync, alternating A/B timing, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent.parent / "reports" / "bench"


def sync(device: torch.device) -> None:
    """Wait for queued device work before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call, device synchronised on both sides."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[[], object]], reps: int, device: torch.device, warmup: int = 1) -> dict:
    """Run the candidates in turn ``reps`` times (after ``warmup`` rounds); medians in seconds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """What the numbers were measured on."""
    info = {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def write(name: str, result: dict, out_dir: Path | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` (default ``reports/bench``) atomically and return its path."""
    out_dir = OUT_DIR if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def prose_windows(tokenizer, tokens: int, window: int, prefix: int) -> list:
    """Perplexity requests (prompt, [continuation]) over stdlib-prose's first text: ``tokens`` scored tokens in
    windows of ``window`` with a ``prefix``-token prompt each, as the perplexity task cuts them."""
    from emad.corpus import build_source
    from emad.tasks.perplexity import perplexity_requests

    text = "\n\n".join(d.text for d in build_source("stdlib-prose").documents())
    ids = tokenizer(text[:100_000])["input_ids"][: tokens + prefix * (tokens // 64 + 1)]
    return perplexity_requests([ids], window, prefix)


def prose_parser(description: str, tokens: int) -> argparse.ArgumentParser:
    """Options of a benchmark on stdlib-prose perplexity windows (:func:`load_prose`): ``--model``, ``--tokens``
    (default ``tokens``), ``--window``, ``--prefix``, ``--reps``, ``--device``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=tokens, help="scored perplexity tokens")
    parser.add_argument("--window", type=int, default=96)
    parser.add_argument("--prefix", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    return parser


def load_prose(args: argparse.Namespace) -> tuple:
    """The model of ``args`` (float32), its layer stack, the windows of :func:`prose_windows` and their scored
    token count: ``(loaded, stack, requests, scored_tokens)``."""
    from emad.engine.models import load_model
    from emad.engine.stack import LayerStack

    loaded = load_model(args.model, device=args.device, dtype="float32")
    requests = prose_windows(loaded.tokenizer, args.tokens, args.window, args.prefix)
    return loaded, LayerStack(loaded.model), requests, sum(len(c) for _, cs in requests for c in cs)


@torch.inference_mode()
def decode_step_layer(stack, layer: int, reps: int, context: int = 128) -> tuple[float, torch.Tensor]:
    """Median seconds of running decoder layer ``layer`` (1-based) for one new token over ``context`` keys, and a
    real last hidden state ``[1, d]`` of that context (for timing probes on)."""
    from emad.decode import positions_of

    ids = torch.randint(0, stack.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(stack.device)
    real = torch.ones_like(ids, dtype=torch.bool)
    cache = stack.new_cache(1, context + reps + 8)
    pos = positions_of(real)
    h_all = stack.run(stack.embed(ids, pos), 0, stack.n_layers, cache, pos, cache.allocate(real))
    step_pos = pos[:, -1:] + 1
    h = stack.embed(ids[:, :1], step_pos)  # [1, 1, d]
    times = []
    for _ in range(reps):
        slots = cache.allocate(torch.ones(1, 1, dtype=torch.bool, device=stack.device))
        times.append(timed(lambda s=slots: stack.run(h, layer - 1, layer, cache, step_pos, s), stack.device))
    return statistics.median(times), h_all[:, -1]


def probe_seconds(estimator, stack, h: torch.Tensor, layer: int, reps: int) -> tuple[float, object]:
    """Median seconds of one probe by ``estimator`` at ``layer`` on the hidden state ``h`` ``[1, d]``, and the
    estimate of the warm-up call before the timed ones (which builds SVDs and shortlist rows)."""
    result = estimator.estimate(stack, h, layer)
    seconds = statistics.median(timed(lambda: estimator.estimate(stack, h, layer), stack.device) for _ in range(reps))
    return seconds, result
