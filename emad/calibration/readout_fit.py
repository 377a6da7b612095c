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
step. Each layer keeps the epoch of its own lowest held-out KL (the identity among the candidates) and stops on
its own. Seeded; resumable from a per-epoch checkpoint.
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


def _logits(stack: LayerStack, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """head(final_norm(x)) through the head's rows ``weight`` ``[R, d]`` (all or a subset), softcap applied:
    ``[n, R]``."""
    logits = stack.final_norm(x) @ weight.T
    if stack.softcap is not None:
        logits = torch.tanh(logits / stack.softcap) * stack.softcap
    return logits.float()


def kl(logp: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ softmax(student)) per row, nats, from the teacher's log-probabilities ``logp``: ``[n]``."""
    return (logp.exp() * (logp - torch.log_softmax(student, -1))).sum(-1)


def vocabulary_subset(top: torch.Tensor, vocab_size: int, sample: int | None,
                      generator: torch.Generator) -> torch.Tensor | None:
    """The union of the batch's teacher top-k ids and ``sample`` uniform draws; None means the whole vocabulary."""
    if sample is None or sample + top.numel() >= vocab_size:
        return None
    drawn = torch.randint(vocab_size, (sample,), generator=generator)
    return torch.unique(torch.cat([top.flatten(), drawn]))


def batch_loss(stack: LayerStack, lens: TunedLens, part: Sample, rows: torch.Tensor | None, scale: float,
               layers: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_ℓ mean-KL of the tokens of ``part`` on vocabulary ``rows`` over ``layers`` (None: all of ``part.layers``),
    times ``scale`` (1/global batch × local tokens makes rank losses add up to the batch mean); also the per-layer
    KL sums ``[len(layers)]`` (detached)."""
    device = stack.device
    weight = stack.head.weight if rows is None else stack.head.weight[rows.to(device)]  # [R, d], indexed once
    with torch.no_grad():
        logp = torch.log_softmax(_logits(stack, part.final.to(device, stack.dtype), weight), -1)  # [n, R]
    per_layer = []
    for layer in part.layers if layers is None else layers:
        h = part.hidden[:, part.layers.index(layer)].to(device, torch.float32)  # [n, d]
        per_layer.append(kl(logp, _logits(stack, lens.translators[layer](h).to(stack.dtype), weight)).sum())
    sums = torch.stack(per_layer)  # [len(layers)]
    return sums.sum() * scale, sums.detach()


@torch.no_grad()
def held_out_kl(stack: LayerStack, lens: TunedLens, sample: Sample, rows: torch.Tensor | None,
                chunk: int = 512, layers: Sequence[int] | None = None) -> torch.Tensor:
    """Mean KL per layer ``[len(layers)]`` of ``sample`` on vocabulary ``rows`` (the early-stopping score)."""
    sums = sum(batch_loss(stack, lens, sample.take(slice(i, i + chunk)), rows, 1.0, layers)[1].double().cpu()
               for i in range(0, len(sample), chunk))
    return sums / len(sample)


def _score(logits: torch.Tensor, logp: torch.Tensor, p: torch.Tensor, top1: torch.Tensor, tgt: torch.Tensor,
           has: torch.Tensor) -> torch.Tensor:
    """Sums over tokens of KL(final ‖ read), top-1 agreements and next-token NLL: ``[3]`` (float64, CPU), from the
    final log-probabilities ``logp`` and probabilities ``p`` ``[n, V]``."""
    logq = torch.log_softmax(logits, -1)  # [n, V]
    nll = -logq.gather(-1, tgt[:, None])[:, 0]  # [n]
    return torch.stack([(p * (logp - logq)).sum(), (logits.argmax(-1) == top1).sum(),
                        nll[has].sum()]).double().cpu()


@torch.no_grad()
def evaluate(stack: LayerStack, readouts: Mapping[str, Readout], sample: Sample,
             chunk: int = 256) -> dict[str, dict[int, dict[str, float]]]:
    """Per readout and layer (and L): mean KL to the final layer, top-1 agreement with it, and perplexity of the next
    token, on the full vocabulary. The final distribution is computed once per chunk, and states that two readouts
    translate alike (an identity translator), or that equal the final state, are read out once:
    ``{name: {layer: metrics}}``."""
    device, layers = stack.device, sample.layers
    sums = {name: {layer: torch.zeros(3, dtype=torch.float64) for layer in [*layers, stack.n_layers]}
            for name in readouts}  # KL, agreements, NLL
    n, n_next = len(sample), int((sample.targets >= 0).sum())
    for i in range(0, n, chunk):
        part = sample.take(slice(i, i + chunk))
        teacher = _logits(stack, part.final.to(device, stack.dtype), stack.head.weight)  # [n, V]
        logp = torch.log_softmax(teacher, -1)  # log p_L [n, V]
        given = (logp, logp.exp(), teacher.argmax(-1), part.targets.clamp_min(0).to(device),
                 (part.targets >= 0).to(device))  # log p_L, p_L [n, V], its top-1 [n], next token [n], has one [n]
        final = _score(teacher, *given)
        last = part.final.to(device, torch.float32)  # [n, d]: a layer whose state is the final one reads out as L
        for p, layer in enumerate(layers):
            h, seen = part.hidden[:, p].to(device, torch.float32), [(last, final)]  # [n, d]; (state, its score)
            for name, readout in readouts.items():
                x = readout.translate(h, layer)
                hit = next((got for y, got in seen if torch.equal(x, y)), None)
                if hit is None:
                    hit = _score(_logits(stack, x.to(stack.dtype), stack.head.weight), *given)
                    seen.append((x, hit))
                sums[name][layer] += hit
        for name in readouts:
            sums[name][stack.n_layers] += final
    return {name: {layer: {"kl": float(t[0]) / n, "agreement": float(t[1]) / n,
                           "perplexity": float(torch.exp(t[2] / max(n_next, 1)))} for layer, t in per.items()}
            for name, per in sums.items()}


@dataclass
class FitResult:
    """The fitted readout and what fitting measured.

    Attributes:
        lens: per layer, the translator of its best epoch (lowest held-out KL of that layer; 0: the identity).
        held_out: ``{"logit": {layer: metrics}, "tuned": {layer: metrics}}`` (see :func:`evaluate`).
        history: per epoch, ``{"epoch", "train_kl": {layer: mean}, "held_out_kl": {layer: mean}}`` of the layers
            still training (KL on the vocabulary subset when ``vocab_sample`` is set: the early-stopping score).
        best_epoch: layer → the epoch whose translator it kept (0: the identity).
    """

    lens: TunedLens
    held_out: dict[str, dict[int, dict[str, float]]]
    history: list[dict] = field(default_factory=list)
    best_epoch: dict[int, int] = field(default_factory=dict)


def fit(stack: LayerStack, train: Sample, held_out: Sample, fingerprint: dict, *, epochs: int = 8,
        lr: float = 2e-3, rank: int | None = None, seed: int = 0, batch_tokens: int = 256,
        vocab_sample: int | None = 4096, patience: int = 2, checkpoint: str | Path | None = None,
        meta: dict | None = None, on_epoch: Callable[[dict], None] | None = None,
        on_batch: Callable[[int], None] | None = None) -> FitResult:
    """Train translators at ``train.layers`` with Adam; each layer keeps the epoch of its own lowest held-out KL.

    The identity (epoch 0) is every layer's first candidate; a layer whose held-out KL is 0 there (its state is the
    final one) is never trained and keeps A = 0, b = 0 bit for bit. A layer stops (no more updates) after
    ``patience`` epochs without a lower held-out KL; fitting ends when every layer has stopped or after ``epochs``.
    The learning rate falls linearly from ``lr`` to 0 over the ``epochs`` budget. Last, a layer whose kept
    translator reads worse than the logit lens on the full vocabulary is reset to the identity.

    Under ``torch.distributed`` every rank must hold the same ``train`` and ``held_out``; each takes tokens
    ``rank::world`` of every batch, gradients are summed across ranks and rank 0's held-out scores decide.

    Args:
        epochs: at most this many passes over ``train``, each followed by a held-out evaluation.
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
    eval_rows = vocabulary_subset(held_out.top, stack.vocab_size, vocab_sample, torch.Generator().manual_seed(seed))
    initial = {layer: _copy_state(t) for layer, t in lens.translators.items()}
    start = _agreed(held_out_kl(stack, lens, held_out, eval_rows), stack.device, world).tolist()
    state = {"epoch": 0, "step": 0, "history": [], "best": dict(zip(train.layers, start)),
             "best_epoch": dict.fromkeys(train.layers, 0), "best_state": dict(initial),
             "stale": dict.fromkeys(train.layers, 0),
             "active": [layer for layer, kl0 in zip(train.layers, start) if kl0 > 0]}  # KL 0 cannot improve
    key = _key(fingerprint, train, held_out, epochs, lr, rank, seed, batch_tokens, vocab_sample, patience, world)
    ckpt = None if checkpoint is None else Path(f"{checkpoint}.rank{rank_id}" if world > 1 else checkpoint)
    _resume(ckpt, key, modules, opt, state)
    total_steps = epochs * -(-len(train) // batch_tokens)
    for epoch in range(state["epoch"] + 1, epochs + 1):
        active = state["active"]
        if not active:
            break
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(len(train), generator=gen)
        sums = torch.zeros(len(active), dtype=torch.float64)  # [len(active)]
        for begin in range(0, len(train), batch_tokens):
            batch = order[begin:begin + batch_tokens]
            for group in opt.param_groups:
                group["lr"] = lr * (1 - state["step"] / total_steps)
            opt.zero_grad(set_to_none=True)  # a stopped layer keeps grad None: Adam leaves it alone
            rows = vocabulary_subset(train.top[batch], stack.vocab_size, vocab_sample, gen)
            loss, layer_sums = batch_loss(stack, lens, train.take(batch[rank_id::world]), rows, 1.0 / len(batch),
                                          active)
            loss.backward()
            if world > 1:
                for p in (p for p in modules.parameters() if p.grad is not None):
                    dist.all_reduce(p.grad)
                dist.all_reduce(layer_sums)
            opt.step()
            state["step"] += 1
            sums += layer_sums.double().cpu()
            if on_batch is not None:
                on_batch(len(batch))
        scores = _agreed(held_out_kl(stack, lens, held_out, eval_rows, layers=active), stack.device, world)
        entry = {"epoch": epoch, "train_kl": dict(zip(active, (sums / len(train)).tolist())),
                 "held_out_kl": dict(zip(active, scores.tolist()))}
        _keep_best(state, lens, epoch, entry["held_out_kl"], patience)
        state["history"].append(entry)
        state["epoch"] = epoch
        if on_epoch is not None:
            on_epoch(entry)
        _save_checkpoint(ckpt, key, modules, opt, state)
    for layer, saved in state["best_state"].items():
        lens.translators[layer].load_state_dict(saved)
    held = _never_worse(stack, lens, held_out, initial, state["best_epoch"])
    best = TunedLens({layer: t.to(torch.float32) for layer, t in lens.translators.items()}, fingerprint,
                     {**(meta or {}), "best_epoch": state["best_epoch"], "epochs_run": state["epoch"]})
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return FitResult(best, held, state["history"], dict(state["best_epoch"]))


def _never_worse(stack: LayerStack, lens: TunedLens, held_out: Sample, initial: dict[int, dict],
                 best_epoch: dict[int, int]) -> dict[str, dict[int, dict[str, float]]]:
    """Held-out metrics of both readouts (:func:`evaluate`); a layer whose translator reads worse than the logit lens
    on the full vocabulary (the subset KL chose it) goes back to the identity, ``best_epoch`` 0."""
    held = evaluate(stack, {"logit": LogitLens(), "tuned": lens}, held_out)
    for layer in lens.layers:
        if held["tuned"][layer]["kl"] > held["logit"][layer]["kl"]:
            log.warning("readout layer %d: the fitted translator reads worse than the logit lens on the full "
                        "vocabulary; keeping the identity", layer)
            lens.translators[layer].load_state_dict(initial[layer])
            best_epoch[layer] = 0
            held["tuned"][layer] = dict(held["logit"][layer])
    return held


def _keep_best(state: dict, lens: TunedLens, epoch: int, scores: dict[int, float], patience: int) -> None:
    """Per layer: keep this epoch's translator if its held-out KL is the lowest yet, else count a stale epoch and
    stop the layer after ``patience`` of them (a non-finite score never improves)."""
    for layer, score in scores.items():
        if score < state["best"][layer]:
            state["best"][layer], state["best_epoch"][layer] = score, epoch
            state["best_state"][layer] = _copy_state(lens.translators[layer])
            state["stale"][layer] = 0
        else:
            state["stale"][layer] += 1
    state["active"] = [layer for layer in state["active"] if state["stale"][layer] < patience]


def _agreed(scores: torch.Tensor, device: torch.device, world: int) -> torch.Tensor:
    """Rank 0's held-out scores on every rank, so that all ranks keep and stop the same layers."""
    if world > 1:
        dist.broadcast(shared := scores.to(device), 0)
        scores = shared.cpu()
    return scores


def _copy_state(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _key(fingerprint, train, held_out, *settings) -> str:
    ident = {"model": fingerprint, "layers": train.layers, "n": len(train), "held_out": len(held_out),
             "train_sum": float(train.final.double().sum()), "settings": list(settings)}
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
    every later layer the identity (its held-out KL is 0 from the start: never trained), with the held-out metrics
    of the final state; the training history and best epochs are the base fit's.

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
    best = {**{int(k): v for k, v in metrics["best_epoch"].items()}, **{ly: 0 for ly in layers if ly >= n_base}}
    lens.meta = {**base.meta, "best_epoch": best}
    held = {}
    for name, per in metrics["held_out"].items():  # the final state's metrics at the base's L and every later layer
        final = per[str(n_base)]
        held[name] = {**{int(k): v for k, v in per.items() if int(k) < n_base},
                      **{layer: dict(final) for layer in [*layers, n_layers] if layer >= n_base}}
    return FitResult(lens, held, list(metrics["history"]), best)


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
