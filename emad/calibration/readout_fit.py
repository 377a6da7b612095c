"""Fitting the ``tuned`` readout: an affine translator T_ℓ per probe layer, model frozen.

The loss of a token is Σ_ℓ KL(p_L ‖ p_ℓ), where p_L is the model's final distribution and
p_ℓ = softmax(head(final_norm(T_ℓ(h_ℓ)))). Hidden states are collected once (one teacher-forcing pass over the
calibration windows); training then only runs translators, final norm and head.

The head's softmax over the vocabulary dominates the cost. With ``vocab_sample`` set, the KL of a batch is taken
over a subset of the vocabulary: the union of the teacher's top ``top_k`` tokens of every token in the batch plus
``vocab_sample`` tokens drawn uniformly (a fresh draw per step, the same on every rank); both distributions are
renormalised on it. Held-out metrics always use the full vocabulary.

Data-parallel under ``torch.distributed``: every rank takes its share of each batch's tokens, the loss is
normalised by the global batch size and gradients are all-reduced (summed), so a step equals the single-process
step. Seeded; resumable from a per-epoch checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from emad.engine.stack import LayerStack
from emad.exits.readouts import LogitLens, Readout, TunedLens
from emad.io import atomic_write_bytes

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """What fitting reads, per token (N tokens, P translated layers).

    Attributes:
        hidden: ``[N, P, d]`` hidden states after each layer of ``layers`` (float32, CPU).
        final: ``[N, d]`` hidden state after layer L.
        top: ``[N, k]`` the teacher's top-k token ids.
        targets: ``[N]`` the next token (-1 where the window ends).
        layers: the P layers.
    """

    hidden: torch.Tensor
    final: torch.Tensor
    top: torch.Tensor
    targets: torch.Tensor
    layers: list[int]

    def __len__(self) -> int:
        return self.final.shape[0]

    def take(self, idx: torch.Tensor | slice) -> Sample:
        return Sample(self.hidden[idx], self.final[idx], self.top[idx], self.targets[idx], self.layers)


@torch.no_grad()  # not inference_mode: the kept states feed autograd later
def collect(stack: LayerStack, token_windows: Sequence[Sequence[int]], layers: Sequence[int], top_k: int = 32,
            batch_size: int = 4) -> Sample:
    """Run the frozen model over ``token_windows`` and keep what fitting needs (see :class:`Sample`)."""
    hidden, final, top, targets = [], [], [], []
    for i in range(0, len(token_windows), batch_size):
        batch = [list(w) for w in token_windows[i:i + batch_size]]
        width = max(len(w) for w in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        real = torch.zeros(len(batch), width, dtype=torch.bool)
        nxt = torch.full((len(batch), width), -1, dtype=torch.long)
        for r, w in enumerate(batch):
            ids[r, : len(w)] = torch.tensor(w)
            real[r, : len(w)] = True
            nxt[r, : len(w) - 1] = torch.tensor(w[1:])
        ids, real = ids.to(stack.device), real.to(stack.device)
        positions = torch.arange(width, device=stack.device).expand(len(batch), -1)  # [B, T]
        cache = stack.new_cache(len(batch), width)
        slots = cache.allocate(torch.ones_like(real))
        h, done, kept = stack.embed(ids, positions), 0, []
        for layer in [*layers, stack.n_layers]:
            h = stack.run(h, done, layer, cache, positions, slots)
            done = layer
            kept.append(h[real].float().cpu())  # [n, d]
        logits = stack.readout(h[real])  # [n, V], through the final layer (never translated)
        hidden.append(torch.stack(kept[:-1], dim=1))
        final.append(kept[-1])
        top.append(logits.topk(top_k, dim=-1).indices.cpu())
        targets.append(nxt[real.cpu()])
    return Sample(torch.cat(hidden), torch.cat(final), torch.cat(top), torch.cat(targets), list(layers))


def _logits(stack: LayerStack, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """head(final_norm(x)) on the vocabulary subset ``rows`` (None: all of it), softcap applied: ``[n, |rows|]``."""
    weight = stack.head.weight if rows is None else stack.head.weight[rows]
    logits = stack.final_norm(x) @ weight.T
    if stack.softcap is not None:
        logits = torch.tanh(logits / stack.softcap) * stack.softcap
    return logits.float()


def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) ‖ softmax(student)) per row, nats: ``[n]``."""
    logp = torch.log_softmax(teacher, -1)
    return (logp.exp() * (logp - torch.log_softmax(student, -1))).sum(-1)


def vocabulary_subset(top: torch.Tensor, vocab_size: int, sample: int | None,
                      generator: torch.Generator) -> torch.Tensor | None:
    """The union of the batch's teacher top-k ids and ``sample`` uniform draws; None means the whole vocabulary."""
    if sample is None or sample + top.numel() >= vocab_size:
        return None
    drawn = torch.randint(vocab_size, (sample,), generator=generator)
    return torch.unique(torch.cat([top.flatten(), drawn]))


def batch_loss(stack: LayerStack, lens: TunedLens, part: Sample, rows: torch.Tensor | None,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_ℓ mean-KL of the tokens of ``part`` on vocabulary ``rows``, times ``scale`` (1/global batch × local
    tokens makes rank losses add up to the batch mean); also the per-layer KL sums ``[P]`` (detached)."""
    device = stack.device
    with torch.no_grad():
        teacher = _logits(stack, part.final.to(device, stack.dtype), None if rows is None else rows.to(device))
    per_layer = []
    for p, layer in enumerate(part.layers):
        x = lens.translators[layer](part.hidden[:, p].to(device, torch.float32)).to(stack.dtype)
        per_layer.append(kl(teacher, _logits(stack, x, None if rows is None else rows.to(device))).sum())
    sums = torch.stack(per_layer)  # [P]
    return sums.sum() * scale, sums.detach()


@torch.no_grad()
def held_out_kl(stack: LayerStack, lens: TunedLens, sample: Sample, rows: torch.Tensor | None,
                chunk: int = 512) -> torch.Tensor:
    """Mean KL per layer ``[P]`` of ``sample`` on vocabulary ``rows`` (the early-stopping score)."""
    sums = sum(batch_loss(stack, lens, sample.take(slice(i, i + chunk)), rows, 1.0)[1].double().cpu()
               for i in range(0, len(sample), chunk))
    return sums / len(sample)


@torch.no_grad()
def evaluate(stack: LayerStack, readout: Readout, sample: Sample, chunk: int = 256) -> dict[int, dict[str, float]]:
    """Per layer (and L) read through ``readout``: mean KL to the final layer, top-1 agreement with it, and
    perplexity of the next token, on the full vocabulary."""
    device, layers = stack.device, sample.layers
    totals = {layer: {"kl": 0.0, "agree": 0.0, "nll": 0.0} for layer in [*layers, stack.n_layers]}
    n, n_next = len(sample), int((sample.targets >= 0).sum())
    for i in range(0, n, chunk):
        part = sample.take(slice(i, i + chunk))
        teacher = _logits(stack, part.final.to(device, stack.dtype), None)
        top1 = teacher.argmax(-1)
        has = part.targets >= 0
        tgt = part.targets.clamp_min(0).to(device)
        states = [readout.translate(part.hidden[:, p].to(device, torch.float32), layer).to(stack.dtype)
                  for p, layer in enumerate(layers)]
        for layer, logits in [*((ly, _logits(stack, x, None)) for ly, x in zip(layers, states)),
                              (stack.n_layers, teacher)]:
            t = totals[layer]
            t["kl"] += float(kl(teacher, logits).sum())
            t["agree"] += float((logits.argmax(-1) == top1).sum())
            nll = -torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0]
            t["nll"] += float(nll[has.to(device)].sum())
    return {layer: {"kl": t["kl"] / n, "agreement": t["agree"] / n,
                    "perplexity": float(torch.exp(torch.tensor(t["nll"] / max(n_next, 1))))}
            for layer, t in totals.items()}


@dataclass
class FitResult:
    """The fitted readout and what fitting measured.

    Attributes:
        lens: the best translators (lowest held-out KL summed over layers).
        held_out: ``{"logit": {layer: metrics}, "tuned": {layer: metrics}}`` (see :func:`evaluate`).
        history: per epoch, ``{"epoch", "train_kl": {layer: mean}, "held_out_kl": {layer: mean}}`` (KL on the
            vocabulary subset when ``vocab_sample`` is set: the early-stopping score).
        best_epoch: the epoch whose translators were kept (0: the identity).
    """

    lens: TunedLens
    held_out: dict[str, dict[int, dict[str, float]]]
    history: list[dict] = field(default_factory=list)
    best_epoch: int = 0


def fit(stack: LayerStack, train: Sample, held_out: Sample, fingerprint: dict, *, epochs: int = 8,
        lr: float = 1e-3, rank: int | None = None, seed: int = 0, batch_tokens: int = 256,
        vocab_sample: int | None = 4096, patience: int = 2, checkpoint: str | Path | None = None,
        meta: dict | None = None, on_epoch: Callable[[dict], None] | None = None,
        on_batch: Callable[[int], None] | None = None) -> FitResult:
    """Train translators at ``train.layers`` with Adam; keep the epoch with the lowest held-out KL.

    Under ``torch.distributed`` every rank must hold the same ``train`` and ``held_out``; each takes tokens
    ``rank::world`` of every batch and gradients are summed across ranks.

    Args:
        epochs: passes over ``train`` (early stopping after ``patience`` epochs without improvement).
        rank: translator rank (None: full rank).
        batch_tokens: tokens per optimiser step (over all ranks).
        vocab_sample: uniform vocabulary draws per step for the subset KL (None: full vocabulary).
        checkpoint: file for per-epoch progress; removed when fitting completes.
        on_epoch: called with each epoch's history entry; on_batch with the tokens of each step.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank_id = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(seed)
    for p in stack.model.parameters():
        p.requires_grad_(False)
    lens = TunedLens.identity(train.layers, stack.config.hidden_size, fingerprint, rank, seed).to(
        stack.device, torch.float32)
    modules = lens.modules()
    optimizer = torch.optim.Adam(modules.parameters(), lr=lr)
    eval_rows = vocabulary_subset(held_out.top, stack.vocab_size, vocab_sample, torch.Generator().manual_seed(seed))
    state = {"epoch": 0, "best": float(held_out_kl(stack, lens, held_out, eval_rows).sum()),
             "best_epoch": 0, "best_state": _copy_state(modules), "history": [], "stale": 0}
    key = _key(fingerprint, train, held_out, epochs, lr, rank, seed, batch_tokens, vocab_sample, world)
    ckpt = None if checkpoint is None else Path(f"{checkpoint}.rank{rank_id}" if world > 1 else checkpoint)
    _resume(ckpt, key, modules, optimizer, state)
    n = len(train)
    for epoch in range(state["epoch"] + 1, epochs + 1):
        if state["stale"] >= patience:
            break
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=gen)
        sums, seen = torch.zeros(len(train.layers), dtype=torch.float64), 0
        for start in range(0, n, batch_tokens):
            batch = order[start:start + batch_tokens]
            rows = vocabulary_subset(train.top[batch], stack.vocab_size, vocab_sample, gen)
            mine = batch[rank_id::world]
            optimizer.zero_grad(set_to_none=False)
            loss, layer_sums = batch_loss(stack, lens, train.take(mine), rows, 1.0 / len(batch))
            loss.backward()
            if world > 1:
                for p in modules.parameters():
                    dist.all_reduce(p.grad)
                dist.all_reduce(layer_sums)
            optimizer.step()
            sums += layer_sums.double().cpu()
            seen += len(batch)
            if on_batch is not None:
                on_batch(len(batch))
        scores = held_out_kl(stack, lens, held_out, eval_rows)
        total = float(scores.sum())
        entry = {"epoch": epoch, "train_kl": dict(zip(train.layers, (sums / seen).tolist())),
                 "held_out_kl": dict(zip(train.layers, scores.tolist()))}
        state["history"].append(entry)
        if total < state["best"]:
            state.update(best=total, best_epoch=epoch, best_state=_copy_state(modules), stale=0)
        else:
            state["stale"] += 1
        state["epoch"] = epoch
        if on_epoch is not None:
            on_epoch(entry)
        _save_checkpoint(ckpt, key, modules, optimizer, state)
    modules.load_state_dict(state["best_state"])
    best = TunedLens({layer: t.to(torch.float32) for layer, t in lens.translators.items()}, fingerprint,
                     {**(meta or {}), "best_epoch": state["best_epoch"], "epochs_run": state["epoch"]})
    logit_metrics, tuned_metrics = evaluate(stack, LogitLens(), held_out), evaluate(stack, best, held_out)
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return FitResult(best, {"logit": logit_metrics, "tuned": tuned_metrics}, state["history"], state["best_epoch"])


def _copy_state(modules: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in modules.state_dict().items()}


def _key(fingerprint, train, held_out, epochs, lr, rank, seed, batch_tokens, vocab_sample, world) -> str:
    ident = {"model": fingerprint, "layers": train.layers, "n": len(train), "held_out": len(held_out),
             "train_sum": float(train.final.double().sum()), "epochs": epochs, "lr": lr, "rank": rank, "seed": seed,
             "batch": batch_tokens, "sample": vocab_sample, "world": world}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _save_checkpoint(ckpt: Path | None, key: str, modules, optimizer, state: dict) -> None:
    if ckpt is None:
        return
    buffer = io.BytesIO()
    torch.save({"key": key, "modules": modules.state_dict(), "optimizer": optimizer.state_dict(), "state": state},
               buffer)
    atomic_write_bytes(ckpt, buffer.getvalue())


def _resume(ckpt: Path | None, key: str, modules, optimizer, state: dict) -> None:
    """Load a matching checkpoint (translators, optimiser, epoch, best so far); a damaged one is ignored."""
    if ckpt is None or not ckpt.is_file():
        return
    try:
        saved = torch.load(ckpt, weights_only=False)
        if saved.get("key") != key:
            return
        modules.load_state_dict(saved["modules"])
        optimizer.load_state_dict(saved["optimizer"])
        state.update(saved["state"])
        log.warning("resuming readout fitting from checkpoint %s after epoch %d", ckpt, state["epoch"])
    except (OSError, RuntimeError, KeyError, EOFError, ValueError):
        return


def split_windows(token_windows: list[list[int]], tokens: int, holdout: int) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out windows (the last whole windows holding at least ``holdout`` tokens) and, before them, training
    windows (at most ``tokens`` tokens): both come from the end of the split, so a calibration capped at the
    split's first tokens (``calibrate.max_tokens``) never reads the tokens the translators were fitted on.

    Raises:
        ValueError: fewer than ``holdout`` + 64 tokens in all, naming that minimum.
    """
    total, minimum = sum(len(w) for w in token_windows), holdout + 64
    rest, held, kept = list(token_windows), [], 0
    while rest and kept < holdout:
        held.insert(0, rest.pop())
        kept += len(held[0])
    if total < minimum or sum(len(w) for w in rest) < 64:
        raise ValueError(f"fit_readouts: the calibration split has {total} tokens; readouts.holdout = {holdout} "
                         f"needs at least {minimum} (holdout + 64 training tokens, in whole windows of "
                         f"readouts.window): sample more calibration tokens (corpus.calib_tokens) or lower "
                         f"readouts.holdout")
    train, kept = [], 0
    while rest and kept < tokens:
        w = rest.pop()[-(tokens - kept):]
        train.insert(0, w)
        kept += len(w)
    return [w for w in train if len(w) >= 2], held


def fit_texts(loaded, texts: Sequence[str], cfg, *, checkpoint: str | Path | None = None,
              on_epoch: Callable[[dict], None] | None = None, on_batch: Callable[[int], None] | None = None,
              on_start: Callable[[int], None] | None = None) -> tuple[FitResult, dict]:
    """Fit readouts for a loaded model on texts with a :class:`~emad.calibration.config.ReadoutsConfig`.

    Checks layers, rank and the corpus size before any work; returns the fit and facts for the metrics file
    (layers, tokens, seconds of collection).
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
    train_w, held_w = split_windows(windows(docs, cfg.window), cfg.tokens, cfg.holdout)
    if on_start is not None:
        on_start(sum(len(w) for w in train_w))
    train = collect(stack, train_w, layers, cfg.top_k)
    held = collect(stack, held_w, layers, cfg.top_k)
    fingerprint = loaded.fingerprint.as_dict()
    result = fit(stack, train, held, fingerprint, epochs=cfg.epochs, lr=cfg.lr, rank=cfg.rank, seed=cfg.seed,
                 batch_tokens=cfg.batch_tokens, vocab_sample=cfg.vocab_sample, patience=cfg.patience,
                 checkpoint=checkpoint, meta={"tokens": len(train), "holdout": len(held)}, on_epoch=on_epoch,
                 on_batch=on_batch)
    return result, {"layers": layers, "tokens": len(train), "holdout": len(held)}
