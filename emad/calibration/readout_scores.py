"""Scores of the ``tuned`` readout's fit: the training loss and the per-epoch selection score on a vocabulary
subset, and the full-vocabulary metrics (KL to the final layer, top-1 agreement, perplexity) of a fitted readout.

The head's softmax over the vocabulary dominates the cost. With ``vocab_sample`` set, the KL of a batch is taken
over a subset of the vocabulary: the union of the teacher's top ``top_k`` tokens of every token in the batch plus
``vocab_sample`` tokens drawn uniformly; both distributions are renormalised on it. Reported metrics always use the
full vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from emad.calibration.readout_data import Sample
from emad.engine.stack import LayerStack
from emad.exits.readouts import Readout, TunedLens


def head_logits(stack: LayerStack, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
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
        logp = torch.log_softmax(head_logits(stack, part.final.to(device, stack.dtype), weight), -1)  # [n, R]
    per_layer = []
    for layer in part.layers if layers is None else layers:
        h = part.hidden[:, part.layers.index(layer)].to(device, torch.float32)  # [n, d]
        per_layer.append(kl(logp, head_logits(stack, lens.translators[layer](h).to(stack.dtype), weight)).sum())
    sums = torch.stack(per_layer)  # [len(layers)]
    return sums.sum() * scale, sums.detach()


@torch.no_grad()
def selection_kl(stack: LayerStack, lens: TunedLens, sample: Sample, rows: torch.Tensor | None,
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
        teacher = head_logits(stack, part.final.to(device, stack.dtype), stack.head.weight)  # [n, V]
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
                    hit = _score(head_logits(stack, x.to(stack.dtype), stack.head.weight), *given)
                    seen.append((x, hit))
                sums[name][layer] += hit
        for name in readouts:
            sums[name][stack.n_layers] += final
    return {name: {layer: {"kl": float(t[0]) / n, "agreement": float(t[1]) / n,
                           "perplexity": float(torch.exp(t[2] / max(n_next, 1)))} for layer, t in per.items()}
            for name, per in sums.items()}
