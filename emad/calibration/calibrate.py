"""Teacher-forcing calibration pass: readout entropy at every probe layer for every token of a corpus.

Windows of token ids are run through the layer stack in batches; at each probe the readout's entropy and argmax
are taken for every real position and added to :class:`~emad.calibration.stats.CalibrationStats`. Runs data-parallel under
``torchrun`` (each rank a disjoint shard, statistics all-reduced) and resumes from a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from emad.calibration.stats import CalibrationStats, StatsFormatError
from emad.engine.entropy import readout_summary
from emad.engine.stack import LayerStack
from emad.exits.strata import Strata
from emad.io import atomic_write_json

log = logging.getLogger(__name__)


def resolve_probe_layers(spec: Sequence[int] | int, n_layers: int) -> list[int]:
    """Probe layers from a list or from "every k" (an int); the last layer is always included.

    Raises:
        ValueError: a layer outside 1..L, a duplicate, or k outside 1..L.
    """
    if isinstance(spec, int):
        if not 1 <= spec <= n_layers:
            raise ValueError(f"probe_layers: every-k step must be in 1..{n_layers}, got {spec}")
        layers = list(range(spec, n_layers + 1, spec))
    else:
        layers = list(spec)
        for i, layer in enumerate(layers):
            if not isinstance(layer, int) or not 1 <= layer <= n_layers:
                raise ValueError(f"probe_layers[{i}] = {layer!r} is outside 1..{n_layers}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"probe_layers has duplicates: {layers}")
    return sorted(set(layers) | {n_layers})


def windows(documents: Iterable[Sequence[int]], length: int) -> list[list[int]]:
    """Cut token sequences into consecutive windows of ``length`` tokens (a shorter tail of >= 2 kept)."""
    out = []
    for ids in documents:
        for start in range(0, len(ids), length):
            piece = list(ids[start:start + length])
            if len(piece) >= 2:
                out.append(piece)
    return out


def cap_tokens(token_windows: list[list[int]], max_tokens: int | None) -> list[list[int]]:
    """The leading windows holding at most ``max_tokens`` tokens in all (None = all of them)."""
    if max_tokens is None:
        return token_windows
    kept, total = [], 0
    for w in token_windows:
        if total + 2 > max_tokens:
            break
        kept.append(w[: max_tokens - total])
        total += len(kept[-1])
    return kept


@torch.inference_mode()
def accumulate_batch(stack: LayerStack, stats: CalibrationStats, batch: Sequence[Sequence[int]],
                     chunk: int = 2048) -> int:
    """Add one batch of windows to ``stats``; returns the number of tokens added.

    Windows are right-padded: under the causal mask no real token sees padding, and padded positions are
    dropped from the statistics.
    """
    width = max(len(w) for w in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    real = torch.zeros(len(batch), width, dtype=torch.bool)
    for i, w in enumerate(batch):
        ids[i, : len(w)] = torch.tensor(list(w))
        real[i, : len(w)] = True
    ids, real = ids.to(stack.device), real.to(stack.device)
    positions = torch.arange(width, device=stack.device).expand(len(batch), -1)  # [B, T]
    cache = stack.new_cache(len(batch), width)
    slots = cache.allocate(torch.ones_like(real))
    h = stack.embed(ids, positions)  # [B, T, d]
    entropies, argmaxes, first_conf, done = [], [], None, 0
    # the previous probe's T_ℓ(h) [N, d] and readout summaries: a probe whose state translates to the same reads
    # out alike (e.g. after idle layers, which leave h unchanged)
    prev = None
    for probe in stats.probe_layers:
        h = stack.run(h, done, probe, cache, positions, slots)
        done = probe
        flat = h[real]  # [N, d]
        moved = stack.translate(flat, probe)
        if prev is None or not torch.equal(moved, prev[0]):
            prev = moved, [readout_summary(stack.readout(flat[i:i + chunk], probe))
                           for i in range(0, flat.shape[0], chunk)]
        parts = prev[1]
        entropies.append(torch.cat([p[0] for p in parts]))
        argmaxes.append(torch.cat([p[1] for p in parts]))
        if first_conf is None:
            first_conf = torch.cat([p[2] for p in parts])
    strata = stats.strata.assign(positions[real], first_conf)
    stats.add(torch.stack(entropies, -1), torch.stack(argmaxes, -1), strata)
    return int(real.sum())


def _checkpoint_key(stats: CalibrationStats, n_windows: int, batch_size: int, rank: int, world: int,
                    readout_digest: str) -> str:
    ident = {"probes": stats.probe_layers, "strata": stats.strata.as_dict(), "bins": stats.hist_bins,
             "readout": stats.readout, "readout_digest": readout_digest,
             "model": stats.model, "corpus": stats.corpus, "windows": n_windows, "batch": batch_size,
             "rank": rank, "world": world}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def calibrate(
    stack: LayerStack,
    token_windows: Sequence[Sequence[int]],
    probe_layers: list[int],
    strata: Strata,
    batch_size: int = 8,
    hist_bins: int = 100,
    model: dict | None = None,
    corpus: str = "",
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 20,
    on_batch: Callable[[int], None] | None = None,
) -> CalibrationStats:
    """Run the calibration pass over ``token_windows`` and return merged statistics.

    Under ``torch.distributed`` (initialised by the caller, e.g. via torchrun) each rank takes windows
    ``rank::world``, and the statistics are all-reduced so every rank returns the same totals.

    Args:
        stack: the model's layer stack; entropies are read through its readout (recorded in the stats).
        token_windows: token-id windows (see :func:`windows`).
        probe_layers: probe layers, 1-based, ending at L.
        strata: the stratification.
        batch_size: windows per forward pass.
        hist_bins: entropy histogram bins.
        model: model fingerprint recorded in the stats.
        corpus: corpus manifest hash recorded in the stats.
        checkpoint: file for resumable progress (per rank); removed when the pass completes.
        checkpoint_every: batches between checkpoints.
        on_batch: called with the number of tokens of each finished batch (progress bars).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    stats = CalibrationStats(probe_layers, strata, stack.vocab_size, hist_bins, model or {}, corpus,
                             stack.readout_name)
    shard = list(token_windows)[rank::world]
    batches = [shard[i:i + batch_size] for i in range(0, len(shard), batch_size)]
    ckpt = None if checkpoint is None else Path(f"{checkpoint}.rank{rank}" if world > 1 else checkpoint)
    key = _checkpoint_key(stats, len(token_windows), batch_size, rank, world,
                          "" if stack.lens is None else stack.lens.digest)
    start = _resume(ckpt, key, stats)
    for i in range(start, len(batches)):
        tokens = accumulate_batch(stack, stats, batches[i])
        if on_batch is not None:
            on_batch(tokens)
        if ckpt is not None and (i + 1) % checkpoint_every == 0 and i + 1 < len(batches):
            atomic_write_json(ckpt, {"key": key, "done_batches": i + 1, "stats": stats.to_dict()})
    if world > 1:
        for array in stats.arrays():
            moved = torch.from_numpy(array).to(stack.device)
            dist.all_reduce(moved)
            array[...] = moved.cpu().numpy()
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return stats


def _resume(ckpt: Path | None, key: str, stats: CalibrationStats) -> int:
    """Load a matching checkpoint into ``stats``; return the number of batches already done."""
    if ckpt is None or not ckpt.is_file():
        return 0
    try:
        saved = json.loads(ckpt.read_text(encoding="utf-8"))
        if saved.get("key") != key:
            return 0
        stats.merge(CalibrationStats.from_dict(saved["stats"], str(ckpt)))
        done = int(saved["done_batches"])
        log.warning("resuming from checkpoint %s: %d batches already done", ckpt, done)
        return done
    except (json.JSONDecodeError, KeyError, StatsFormatError, ValueError):
        return 0  # a damaged checkpoint only costs the work it held


def calibrate_texts(loaded, texts: Sequence[str], cfg, corpus: str = "", checkpoint: str | Path | None = None,
                    on_batch: Callable[[int], None] | None = None,
                    on_start: Callable[[int], None] | None = None, readout=None) -> CalibrationStats:
    """Calibrate a loaded model on texts with a :class:`~emad.calibration.config.CalibrateConfig`.

    Checks the probe layers and window against the model before any work, tokenizes, cuts windows, caps them at
    ``cfg.max_tokens`` and runs :func:`calibrate`. ``on_start`` receives the number of tokens to process.
    ``readout`` (an :class:`emad.exits.readouts.Readout`, checked against the model and the probe layers) is
    what the entropies are read through; None: the logit lens.
    """
    stack = LayerStack(loaded.model)
    probes = resolve_probe_layers(cfg.probe_layers, stack.n_layers)
    if readout is not None:
        readout.check(loaded.fingerprint.as_dict(), probes, stack.n_layers)
        stack = stack.with_readout(readout)
    if stack.max_positions is not None and cfg.window > stack.max_positions:
        raise ValueError(f"calibrate.window = {cfg.window} exceeds the model's context of {stack.max_positions}")
    strata = cfg.strata.build()
    docs = [loaded.tokenizer(t)["input_ids"] for t in texts]
    wins = cap_tokens(windows(docs, cfg.window), cfg.max_tokens)
    if not wins:
        raise ValueError("no calibration window of at least 2 tokens: the texts are empty")
    if on_start is not None:
        on_start(sum(len(w) for w in wins))
    return calibrate(stack, wins, probes, strata, cfg.batch_size, cfg.hist_bins,
                     model=loaded.fingerprint.as_dict(), corpus=corpus, checkpoint=checkpoint,
                     checkpoint_every=cfg.checkpoint_every, on_batch=on_batch)
