"""Fitting the ``tuned`` readout: an affine translator T_ℓ per probe layer, model frozen.

The loss of a token is Σ_ℓ KL(p_L ‖ p_ℓ), where p_L is the model's final distribution and
p_ℓ = softmax(head(final_norm(T_ℓ(h_ℓ)))). Hidden states are collected once (one teacher-forcing pass over the
calibration windows, :mod:`emad.calibration.readout_data`); training then only runs translators, final norm and
head, on a vocabulary subset (:mod:`emad.calibration.readout_scores`; a fresh draw per step, the same on every rank).

Three disjoint token ranges: training tokens fit the translators; selection tokens score every epoch, so that each
layer keeps the epoch of its own lowest selection KL (the identity among the candidates) and stops on its own after
``patience`` epochs without improvement, and judge the kept translator against the logit lens; held-out tokens are
only reported. The learning rate is constant, so no epoch is favoured by the schedule: a layer stops on a plateau
of its selection KL, or at the epoch cap (each layer's reason is recorded).

Data-parallel under ``torch.distributed``: every rank takes its share of each batch's tokens, the loss is
normalised by the global batch size and gradients are all-reduced (summed), so a step equals the single-process
step. Seeded; resumable from a per-epoch checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from emad.calibration.readout_data import Sample, Splits, collect, split_windows
from emad.calibration.readout_scores import batch_loss, evaluate, kl, selection_kl, vocabulary_subset
from emad.engine.stack import LayerStack
from emad.exits.readouts import LogitLens, TunedLens
from emad.io import atomic_write_bytes

__all__ = ["FitResult", "Sample", "Splits", "batch_loss", "collect", "evaluate", "fit", "fit_texts", "grown_fit",
           "kl", "result_metrics", "selection_kl", "split_windows", "vocabulary_subset"]

log = logging.getLogger(__name__)

PATIENCE, CAP, FINAL_STATE = "patience", "cap", "final state"  # why a layer stopped training
TRAIN_REPORTED = 512  # training tokens whose full-vocabulary metrics are reported (the overfitting gap)
METRICS_KEYS = {"held_out": "held_out", "selection": "selection_metrics", "train": "train_metrics"}  # in metrics.json


@dataclass
class FitResult:
    """The fitted readout and what fitting measured.

    Attributes:
        lens: per layer, the translator of its best epoch (lowest selection KL of that layer; 0: the identity).
        held_out: ``{"logit": {layer: metrics}, "tuned": {layer: metrics}}`` on the held-out tokens, full
            vocabulary (see :func:`~emad.calibration.readout_scores.evaluate`): reported, never used to choose.
        history: per epoch, ``{"epoch", "train_kl": {layer: mean}, "selection_kl": {layer: mean}}`` of the layers
            still training (KL on the vocabulary subset when ``vocab_sample`` is set: the early-stopping score).
        best_epoch: layer → the epoch whose translator it kept (0: the identity).
        selection: as ``held_out``, on the selection tokens (where each layer was judged against the logit lens).
        train: ``{"tuned": {layer: metrics}}`` on the first ``TRAIN_REPORTED`` training tokens.
        stopped: layer → ``{"reason", "epoch"}``: ``patience`` (no lower selection KL in ``patience`` epochs up to
            that epoch), ``cap`` (still improving at the epoch cap) or ``final state`` (its state is the final one:
            never trained, epoch 0).
    """

    lens: TunedLens
    held_out: dict[str, dict[int, dict[str, float]]]
    history: list[dict] = field(default_factory=list)
    best_epoch: dict[int, int] = field(default_factory=dict)
    selection: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    train: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    stopped: dict[int, dict] = field(default_factory=dict)


def fit(stack: LayerStack, train: Sample, selection: Sample, held_out: Sample, fingerprint: dict, *,
        epochs: int = 8, lr: float = 2e-3, rank: int | None = None, seed: int = 0,
        batch_tokens: int = 256, vocab_sample: int | None = 4096, patience: int = 2, min_delta: float = 0.0,
        checkpoint: str | Path | None = None, meta: dict | None = None,
        on_epoch: Callable[[dict], None] | None = None, on_batch: Callable[[int], None] | None = None) -> FitResult:
    """Train translators at ``train.layers`` with Adam; each layer keeps the epoch of its own lowest selection KL.

    The identity (epoch 0) is every layer's first candidate; a layer whose selection KL is 0 there (its state is the
    final one) is never trained and keeps A = 0, b = 0 bit for bit. A layer stops (no more updates) on a plateau:
    after ``patience`` epochs none of which lowered its selection KL by more than ``min_delta`` (relative) below the
    last epoch that did; fitting ends when every layer has stopped or after ``epochs``. The learning rate is ``lr``
    throughout. Last, a layer whose kept translator reads worse than the logit lens on the selection tokens' full
    vocabulary is reset to the identity; ``held_out`` is only evaluated, at the end.

    Under ``torch.distributed`` every rank must hold the same samples; each takes tokens ``rank::world`` of every
    batch, gradients are summed across ranks and rank 0's selection scores decide.

    Args:
        epochs: at most this many passes over ``train``, each followed by a selection evaluation (the cap).
        min_delta: the relative fall of the selection KL that counts as an improvement for ``patience`` (0: any
            fall); the kept translator is the lowest scoring one either way.
        rank: translator rank (None: full rank).
        batch_tokens: tokens per optimiser step (over all ranks).
        vocab_sample: uniform vocabulary draws per step for the subset KL (None: full vocabulary).
        checkpoint: file for per-epoch progress; removed when fitting completes.
        on_epoch: called with each epoch's history entry; on_batch with the tokens of each step.
    """
    world, rank_id = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    torch.manual_seed(seed)
    stack.model.requires_grad_(False)
    lens = TunedLens.identity(train.layers, stack.config.hidden_size, fingerprint, rank, seed).to(
        stack.device, torch.float32)
    modules = lens.modules()
    opt = torch.optim.Adam(modules.parameters(), lr=lr)
    rows = vocabulary_subset(selection.top, stack.vocab_size, vocab_sample, torch.Generator().manual_seed(seed))
    initial = {layer: _copy_state(t) for layer, t in lens.translators.items()}
    state = _start_state(_agreed(selection_kl(stack, lens, selection, rows), stack.device, world).tolist(),
                         train.layers, initial)
    key = _key(fingerprint, (train, selection, held_out), epochs, lr, rank, seed, batch_tokens, vocab_sample,
               patience, min_delta, world)
    ckpt = None if checkpoint is None else Path(f"{checkpoint}.rank{rank_id}" if world > 1 else checkpoint)
    _resume(ckpt, key, modules, opt, state)
    for epoch in range(state["epoch"] + 1, epochs + 1):
        active = state["active"]
        if not active:
            break
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        train_kl = _train_epoch(stack, lens, opt, train, active, gen, batch_tokens, vocab_sample, on_batch)
        scores = _agreed(selection_kl(stack, lens, selection, rows, layers=active), stack.device, world)
        entry = {"epoch": epoch, "train_kl": dict(zip(active, train_kl)),
                 "selection_kl": dict(zip(active, scores.tolist()))}
        _keep_best(state, lens, epoch, entry["selection_kl"], patience, min_delta)
        state["history"].append(entry)
        state["epoch"] = epoch
        if on_epoch is not None:
            on_epoch(entry)
        _save_checkpoint(ckpt, key, modules, opt, state)
    stopped = {**state["stopped"], **{layer: {"reason": CAP, "epoch": state["epoch"]} for layer in state["active"]}}
    result = _finish(stack, lens, state, train, selection, held_out, initial)
    result.stopped = dict(sorted(stopped.items()))
    result.lens.meta = {**(meta or {}), "best_epoch": result.best_epoch, "epochs_run": state["epoch"],
                        "stopped": result.stopped}
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return result


def result_metrics(result: FitResult) -> dict:
    """What ``metrics.json`` holds of a fit (layer keys as strings, as :func:`grown_fit` reads them back): each
    layer's best epoch and why and when it stopped, the training curve, and the full-vocabulary metrics on the
    held-out (``held_out``), selection (``selection_metrics``) and training (``train_metrics``) tokens."""
    def keyed(per_readout: dict) -> dict:
        return {r: {str(k): v for k, v in m.items()} for r, m in per_readout.items()}

    return {"best_epoch": {str(k): v for k, v in result.best_epoch.items()},
            "stopped": {str(k): v for k, v in result.stopped.items()}, "history": result.history,
            **{key: keyed(getattr(result, split)) for split, key in METRICS_KEYS.items()}}


def _start_state(start: list[float], layers: Sequence[int], initial: dict[int, dict]) -> dict:
    """The fit's progress before epoch 1: the identity is every layer's best (selection KL ``start``); a layer
    whose KL is 0 there (its state is the final one) cannot improve and never trains."""
    return {"epoch": 0, "history": [], "best": dict(zip(layers, start)), "best_epoch": dict.fromkeys(layers, 0),
            "reference": dict(zip(layers, start)),
            "best_state": dict(initial), "stale": dict.fromkeys(layers, 0),
            "active": [layer for layer, kl0 in zip(layers, start) if kl0 > 0],
            "stopped": {layer: {"reason": FINAL_STATE, "epoch": 0} for layer, kl0 in zip(layers, start) if kl0 <= 0}}


def _train_epoch(stack: LayerStack, lens: TunedLens, opt: torch.optim.Optimizer, train: Sample,
                 active: list[int], gen: torch.Generator, batch_tokens: int, vocab_sample: int | None,
                 on_batch: Callable[[int], None] | None) -> list[float]:
    """One pass over ``train`` in the order ``gen`` draws, updating the ``active`` layers' translators; their mean
    training KL over the pass (vocabulary subset), per layer."""
    world, rank_id = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    params = list(lens.modules().parameters())
    order = torch.randperm(len(train), generator=gen)
    sums = torch.zeros(len(active), dtype=torch.float64)  # [len(active)]
    for begin in range(0, len(train), batch_tokens):
        batch = order[begin:begin + batch_tokens]
        opt.zero_grad(set_to_none=True)  # a stopped layer keeps grad None: Adam leaves it alone
        rows = vocabulary_subset(train.top[batch], stack.vocab_size, vocab_sample, gen)
        loss, layer_sums = batch_loss(stack, lens, train.take(batch[rank_id::world]), rows, 1.0 / len(batch), active)
        loss.backward()
        if world > 1:
            for p in (p for p in params if p.grad is not None):
                dist.all_reduce(p.grad)
            dist.all_reduce(layer_sums)
        opt.step()
        sums += layer_sums.double().cpu()
        if on_batch is not None:
            on_batch(len(batch))
    return (sums / len(train)).tolist()


def _finish(stack: LayerStack, lens: TunedLens, state: dict, train: Sample, selection: Sample, held_out: Sample,
            initial: dict[int, dict]) -> FitResult:
    """Each layer's best translator, judged against the logit lens on the selection tokens (a worse one goes back
    to the identity, best epoch 0), then measured on the training, selection and held-out tokens."""
    for layer, saved in state["best_state"].items():
        lens.translators[layer].load_state_dict(saved)
    best_epoch = dict(state["best_epoch"])
    chosen = _never_worse(stack, lens, selection, initial, best_epoch)
    held = evaluate(stack, {"logit": LogitLens(), "tuned": lens}, held_out)
    seen = evaluate(stack, {"tuned": lens}, train.take(slice(0, TRAIN_REPORTED)))
    kept = TunedLens({layer: t.to(torch.float32) for layer, t in lens.translators.items()}, lens.fingerprint)
    return FitResult(kept, held, state["history"], best_epoch, chosen, seen)


def _never_worse(stack: LayerStack, lens: TunedLens, selection: Sample, initial: dict[int, dict],
                 best_epoch: dict[int, int]) -> dict[str, dict[int, dict[str, float]]]:
    """Selection metrics of both readouts (full vocabulary); a layer whose translator reads worse than the logit
    lens there (the subset KL chose it) goes back to the identity, ``best_epoch`` 0."""
    chosen = evaluate(stack, {"logit": LogitLens(), "tuned": lens}, selection)
    for layer in lens.layers:
        if chosen["tuned"][layer]["kl"] > chosen["logit"][layer]["kl"]:
            log.warning("readout layer %d: the fitted translator reads worse than the logit lens on the selection "
                        "tokens' full vocabulary; keeping the identity", layer)
            lens.translators[layer].load_state_dict(initial[layer])
            best_epoch[layer] = 0
            chosen["tuned"][layer] = dict(chosen["logit"][layer])
    return chosen


def _keep_best(state: dict, lens: TunedLens, epoch: int, scores: dict[int, float], patience: int,
               min_delta: float = 0.0) -> None:
    """Per layer: keep this epoch's translator if its selection KL is the lowest yet; an epoch that lowers it by more
    than ``min_delta`` (relative) below the reference (the last such epoch's, or the identity's) resets the count
    of stale epochs, any other adds one, and the layer stops after ``patience`` of them (a non-finite score never
    improves)."""
    for layer, score in scores.items():
        if score < state["best"][layer]:
            state["best"][layer], state["best_epoch"][layer] = score, epoch
            state["best_state"][layer] = _copy_state(lens.translators[layer])
        if score < state["reference"][layer] * (1 - min_delta):
            state["reference"][layer], state["stale"][layer] = score, 0
        else:
            state["stale"][layer] += 1
            if state["stale"][layer] >= patience:
                state["stopped"][layer] = {"reason": PATIENCE, "epoch": epoch}
    state["active"] = [layer for layer in state["active"] if state["stale"][layer] < patience]


def _agreed(scores: torch.Tensor, device: torch.device, world: int) -> torch.Tensor:
    """Rank 0's selection scores on every rank, so that all ranks keep and stop the same layers."""
    if world > 1:
        dist.broadcast(shared := scores.to(device), 0)
        scores = shared.cpu()
    return scores


def _copy_state(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _key(fingerprint, samples: Sequence[Sample], *settings) -> str:
    ident = {"model": fingerprint, "layers": samples[0].layers, "n": [len(s) for s in samples],
             "sums": [float(s.final.double().sum()) for s in samples], "settings": list(settings)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _save_checkpoint(ckpt: Path | None, key: str, modules, optimizer, state: dict) -> None:
    if ckpt is not None:
        torch.save({"key": key, "modules": modules.state_dict(), "optimizer": optimizer.state_dict(),
                    "state": state}, buffer := io.BytesIO())
        atomic_write_bytes(ckpt, buffer.getvalue())


def _resume(ckpt: Path | None, key: str, modules, optimizer, state: dict) -> None:
    """Load a matching checkpoint (translators, optimiser, each layer's best and state); ignore a damaged one."""
    if ckpt is None or not ckpt.is_file():
        return
    try:
        saved = torch.load(ckpt, weights_only=False)
        if saved.get("key") != key or set(saved["state"]) != set(state):
            return
        modules.load_state_dict(saved["modules"])
        optimizer.load_state_dict(saved["optimizer"])
        state.update(saved["state"])
        log.warning("resuming readout fitting from checkpoint %s after epoch %d", ckpt, state["epoch"])
    except (OSError, RuntimeError, KeyError, EOFError, ValueError):
        return


def grown_fit(base: TunedLens, metrics: Mapping, fingerprint: dict, layers: Sequence[int], n_layers: int,
              rank: int | None = None, seed: int = 0) -> FitResult:
    """The fit of a model grown by idle layers (:mod:`emad.engine.idle`: ``<base>+idle<N>``) at ``layers``, from its
    base model's fit on the same corpus and settings (``base``, its ``metrics.json`` as ``metrics``).

    Below the base's L the grown model's states are the base model's, and every later state is the final one, bit
    for bit. A fit on it therefore gives each layer below the base's L the base fit's translator (a layer's updates
    read only its own states, the final states, and the batch order and vocabulary draws all layers share), and
    every later layer the identity (its selection KL is 0 from the start: never trained, stopped for its
    ``final state``), with the final state's training, selection and held-out metrics; the training history, best
    epochs and stop reasons below are the base fit's.

    Raises:
        ValueError: the grown model's layers below the base's L are not the base fit's (other readouts settings).
    """
    n_base = int(metrics["model"]["n_layers"])
    below = [layer for layer in layers if layer < n_base]
    if below != sorted(base.layers):
        raise ValueError(f"the base fit has translators at layers {sorted(base.layers)}, the grown model needs "
                         f"{below} below the base's L = {n_base}: fit both with the same readouts settings")
    lens = TunedLens.identity(layers, int(fingerprint["hidden_size"]), fingerprint, rank, seed)
    for layer in below:
        lens.translators[layer].load_state_dict(base.translators[layer].state_dict())
    idle = [layer for layer in layers if layer >= n_base]
    best = {**{int(k): v for k, v in metrics["best_epoch"].items()}, **dict.fromkeys(idle, 0)}
    stopped = {**{int(k): dict(v) for k, v in metrics["stopped"].items()},
               **{layer: {"reason": FINAL_STATE, "epoch": 0} for layer in idle}}
    lens.meta = {**base.meta, "best_epoch": best, "stopped": stopped}
    extended = {split: _extended(metrics[key], n_base, [*idle, n_layers]) for split, key in METRICS_KEYS.items()}
    return FitResult(lens, extended["held_out"], list(metrics["history"]), best, extended["selection"],
                     extended["train"], stopped)


def _extended(per_readout: Mapping, n_base: int, later: Sequence[int]) -> dict[str, dict[int, dict[str, float]]]:
    """Metrics ``{readout: {layer: metrics}}`` of the base fit (layer keys as JSON strings) with the final state's
    metrics (the base's L) at every ``later`` layer of the grown model."""
    out = {}
    for name, per in per_readout.items():
        final = per[str(n_base)]
        out[name] = {**{int(k): v for k, v in per.items() if int(k) < n_base},
                     **{layer: dict(final) for layer in later}}
    return out


def fit_texts(loaded, texts: Sequence[str], cfg, *, checkpoint: str | Path | None = None,
              on_epoch: Callable[[dict], None] | None = None, on_batch: Callable[[int], None] | None = None,
              on_start: Callable[[int], None] | None = None) -> tuple[FitResult, dict]:
    """Fit readouts for a loaded model on texts with a :class:`~emad.calibration.config.ReadoutsConfig`.

    Checks layers, rank and the corpus size (training + selection + held-out tokens) before any work; returns the
    fit and facts for the metrics file (layers, tokens of each split and their token ranges in the split).
    """
    from emad.calibration.calibrate import resolve_probe_layers, windows

    stack = LayerStack(loaded.model)
    d = stack.config.hidden_size
    if cfg.rank is not None and not 1 <= cfg.rank <= d:
        raise ValueError(f"readouts.rank = {cfg.rank} is outside 1..{d} (the hidden size); null = full rank")
    layers = [p for p in resolve_probe_layers(cfg.layers, stack.n_layers) if p < stack.n_layers]
    if not layers:
        raise ValueError(f"readouts.layers = {cfg.layers!r} leaves no layer below L = {stack.n_layers} to translate")
    docs = [loaded.tokenizer(t)["input_ids"] for t in texts]
    splits = split_windows(windows(docs, cfg.window), cfg.tokens, cfg.selection, cfg.holdout)
    if on_start is not None:
        on_start(sum(len(w) for w in splits.train))
    train, chosen, held = (collect(stack, w, layers, cfg.top_k) for w in (splits.train, splits.selection,
                                                                           splits.held_out))
    facts = {"layers": layers, "tokens": len(train), "selection": len(chosen), "holdout": len(held),
             "train_reported": min(len(train), TRAIN_REPORTED), "ranges": splits.ranges}
    result = fit(stack, train, chosen, held, loaded.fingerprint.as_dict(), epochs=cfg.epochs, lr=cfg.lr,
                 rank=cfg.rank, seed=cfg.seed, batch_tokens=cfg.batch_tokens, vocab_sample=cfg.vocab_sample,
                 patience=cfg.patience, min_delta=cfg.min_delta, checkpoint=checkpoint, on_epoch=on_epoch, on_batch=on_batch,
                 meta={k: facts[k] for k in ("tokens", "selection", "holdout")})
    return result, facts
