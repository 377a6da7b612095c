"""Where two generations of the same prompts part, and by how much: what an exactness check reports beside its
yes or no (a compiled engine against the eager one, bfloat16 against float32, ours against HF greedy).

Tokens and depths are compared position by position (row ``r``, token index ``t``: 0 is the prompt's pass). The
first divergence is the earliest token index at which some row's tokens differ (the lowest such row); after it a
row's contexts differ, so later positions say little. At that position the two readouts the tokens were chosen from
(:class:`Readouts`, recorded through ``generate(..., on_logits=...)``) tell whether it was a near-tie (each side's
margin between its best and second-best logit) or a real difference (the largest logit difference).
"""

from __future__ import annotations

import torch


class Readouts:
    """Records each step's readout ``[B, V]`` as ``generate(..., on_logits=Readouts())`` hands it over (copied to
    the host in float32: a compiled step's readout is overwritten by the next step).

    Attributes:
        steps: token index -> ``[B, V]`` float32 on the host.
    """

    def __init__(self):
        self.steps: dict[int, torch.Tensor] = {}

    def __call__(self, t: int, logits: torch.Tensor) -> None:
        self.steps[t] = logits.detach().float().cpu()

    def at(self, row: int, t: int) -> torch.Tensor | None:
        """The readout ``[V]`` row ``row``'s ``t``-th token was chosen from (None where not recorded)."""
        found = self.steps.get(t)
        return None if found is None or row >= found.shape[0] else found[row]


def _first(a: list[list], b: list[list]) -> tuple[int, int] | None:
    """``(row, t)`` of the earliest index where rows of ``a`` and ``b`` differ (the lowest such row), or None."""
    found = [(t, r) for r, (x, y) in enumerate(zip(a, b))
             for t in [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)] if t is not None]
    return None if not found else min(found)[::-1]


def _share(a: list[list], b: list[list]) -> float | None:
    """The share of positions (over the rows' common lengths) where ``a`` and ``b`` agree."""
    pairs = [(u, v) for x, y in zip(a, b) for u, v in zip(x, y)]
    return sum(u == v for u, v in pairs) / len(pairs) if pairs else None


def _margin(logits: torch.Tensor) -> float:
    """The best logit minus the second best of a readout ``[V]``."""
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergence(a_tokens: list[list[int]], b_tokens: list[list[int]], a_depths: list[list[int]] | None = None,
               b_depths: list[list[int]] | None = None, a_readouts: Readouts | None = None,
               b_readouts: Readouts | None = None) -> dict:
    """How generation ``b`` departs from generation ``a`` (same prompts, same number of rows).

    Returns:
        ``equal`` (tokens and depths all equal), ``rows``, ``equal_token_share`` and ``equal_depth_share`` (of
        positions), ``first_token_difference`` (None, or ``row``, ``step``, the two ``tokens``, and where both
        readouts were recorded: ``max_logit_difference``, each side's ``margin`` between its best two logits, and
        ``logit_gap_of_other_token`` — how far below its own choice each side put the other's), and
        ``first_depth_difference`` (None, or ``row``, ``step`` and the two ``depths``).
    """
    if len(a_tokens) != len(b_tokens):
        raise ValueError(f"the generations have {len(a_tokens)} and {len(b_tokens)} rows: compare the same prompts")
    out = {"rows": len(a_tokens), "equal_token_share": _share(a_tokens, b_tokens),
           "equal_depth_share": None, "first_token_difference": None, "first_depth_difference": None}
    where = _first(a_tokens, b_tokens)
    if where is not None:
        r, t = where
        first = {"row": r, "step": t, "tokens": [a_tokens[r][t], b_tokens[r][t]]}
        x = None if a_readouts is None else a_readouts.at(r, t)
        y = None if b_readouts is None else b_readouts.at(r, t)
        if x is not None and y is not None:
            both = torch.isfinite(x) & torch.isfinite(y)
            first["max_logit_difference"] = float((x - y)[both].abs().max()) if bool(both.any()) else None
            first["margin"] = [_margin(x), _margin(y)]
            first["logit_gap_of_other_token"] = [float(x[a_tokens[r][t]] - x[b_tokens[r][t]]),
                                                 float(y[b_tokens[r][t]] - y[a_tokens[r][t]])]
        out["first_token_difference"] = first
    if a_depths is not None and b_depths is not None:
        out["equal_depth_share"] = _share(a_depths, b_depths)
        depth_at = _first(a_depths, b_depths)
        if depth_at is not None:
            r, t = depth_at
            out["first_depth_difference"] = {"row": r, "step": t, "depths": [a_depths[r][t], b_depths[r][t]]}
    out["equal"] = where is None and out["first_depth_difference"] is None
    return out
