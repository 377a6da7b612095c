"""What the ``tuned`` readout's fit reads: the calibration split cut into three disjoint token ranges, and the
frozen model's hidden states on each.

The three ranges come from the end of the calibration split, held-out last: ``training | selection | held-out``.
Training tokens fit the translators; selection tokens choose each layer's best epoch and drive its patience (and
judge it against the logit lens); held-out tokens are only reported. A calibration capped at the split's first
tokens (``calibrate.max_tokens``) therefore never reads a token the translators saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from emad.engine.stack import LayerStack

SPLITS = ("train", "selection", "held_out")


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


@dataclass
class Splits:
    """The three disjoint token ranges of the calibration split, as windows.

    Attributes:
        train, selection, held_out: the windows of each range (a window cut at a range's start keeps its last
            tokens, which start a window of their own).
        ranges: ``{split: [start, end)}``, token offsets into the split (its windows laid end to end).
    """

    train: list[list[int]]
    selection: list[list[int]]
    held_out: list[list[int]]
    ranges: dict[str, list[int]]


def _take_last(rest: list[list[int]], n: int) -> list[list[int]]:
    """The last ``n`` tokens of ``rest`` as windows, removed from it (a window cut in two leaves its head there)."""
    taken, kept = [], 0
    while kept < n:
        window = rest.pop()
        piece = window[len(window) - min(len(window), n - kept):]
        if len(piece) < len(window):
            rest.append(window[:len(window) - len(piece)])
        taken.insert(0, piece)
        kept += len(piece)
    return taken


def split_windows(token_windows: list[list[int]], tokens: int, selection: int, holdout: int) -> Splits:
    """The last ``holdout`` tokens of the split (held-out), the ``selection`` tokens before them and the ``tokens``
    training tokens before those: both evaluation ranges and the training range come from the end of the split, so
    a calibration capped at its first tokens (``calibrate.max_tokens``) never reads them.

    Raises:
        ValueError: the split holds fewer than ``tokens + selection + holdout`` tokens, naming the parameters and
            the smallest ``corpus.calib_tokens`` that holds them.
    """
    total, need = sum(len(w) for w in token_windows), tokens + selection + holdout
    if total < need:
        raise ValueError(f"fit_readouts: the calibration split has {total} tokens, fewer than readouts.tokens + "
                         f"readouts.selection + readouts.holdout = {tokens} + {selection} + {holdout} = {need}: "
                         f"sample more calibration tokens (corpus.calib_tokens >= calibrate.max_tokens + {need}) "
                         f"or lower those three")
    rest = [list(w) for w in token_windows]
    held = _take_last(rest, holdout)
    chosen = _take_last(rest, selection)
    train = _take_last(rest, tokens)
    ranges = {"train": [total - need, total - selection - holdout],
              "selection": [total - selection - holdout, total - holdout], "held_out": [total - holdout, total]}
    return Splits(train, chosen, held, ranges)
