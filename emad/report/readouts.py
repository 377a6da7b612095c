"""The report's "Readouts" section: logit vs tuned readout per layer, the oracle bound under each, and how the
frontier moves when a family reads its layers through the tuned readout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from emad.report.pareto import oracle_bounds
from emad.report.tables import fmt, markdown_table
from emad.report.verdict import ModelVerdict

TUNED = "+tuned"


def layer_table(fit: Mapping[str, Any]) -> str:
    """One row per layer: held-out top-1 agreement with layer L, KL to it and perplexity, logit vs tuned."""
    held = fit["held_out"]
    rows = []
    for layer in sorted(held["logit"], key=int):
        lo, tu = held["logit"][layer], held["tuned"][layer]
        rows.append([str(layer), fmt(lo["agreement"]), fmt(tu["agreement"]), fmt(lo["kl"], ".2f"), fmt(tu["kl"], ".2f"),
                     fmt(lo["perplexity"], ".4g"), fmt(tu["perplexity"], ".4g")])
    return markdown_table(["layer", "agreement (logit)", "agreement (tuned)", "KL (logit)", "KL (tuned)",
                           "perplexity (logit)", "perplexity (tuned)"], rows)


def _best_within(v: ModelVerdict) -> tuple[str, float | None]:
    """The point with the largest FLOPs reduction within every tolerance (label, reduction), else ("–", None)."""
    ok = [p for p in v.points if p.within_tolerance]
    if not ok:
        return "–", None
    best = max(ok, key=lambda p: p.reduction)
    return best.label, best.reduction


def frontier_shift(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> str:
    """Per family with a tuned twin and model: the largest FLOPs reduction within tolerance, logit vs tuned."""
    rows = []
    for family in sorted(f for f in family_verdicts if not f.endswith(TUNED) and f + TUNED in family_verdicts):
        for model, logit in sorted(family_verdicts[family].items()):
            tuned = family_verdicts[family + TUNED].get(model)
            if tuned is None:
                continue
            (lp, lr), (tp, tr) = _best_within(logit), _best_within(tuned)
            rows.append([family, model, lp, fmt(lr, ".1%"), tp, fmt(tr, ".1%"),
                         "yes" if logit.c1.passed else "no", "yes" if tuned.c1.passed else "no"])
    if not rows:
        return "No family ran under both readouts."
    return markdown_table(["family", "model", "best point within tolerance (logit)", "FLOPs reduction",
                           "best point within tolerance (tuned)", "FLOPs reduction", "C1 (logit)", "C1 (tuned)"], rows)


def readouts_markdown(fits: Mapping[str, Mapping[str, Any]], runs: Sequence[dict[str, Any]],
                      family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> str:
    """The section: per fitted readout (``model/source``) its layer table, then oracle bounds and frontier shift.

    Args:
        fits: ``{"model/source": metrics.json of stage fit_readouts}``.
        runs: run records (the oracle bound comes from the profiles the runs used).
        family_verdicts: ``{family: {model: ModelVerdict}}``; a ``family+tuned`` twin is the same family read
            through the tuned readout.
    """
    parts = ["Held-out tokens of the calibration split, read out at each layer through the final norm and head "
             "(`logit`) or through the fitted translator first (`tuned`). Agreement = top-1 equal to layer L's."]
    for name, fit in sorted(fits.items()):
        parts += [f"### {name}: {fit['tokens']} training tokens, {len(fit['history'])} epochs "
                  f"(best {fit['best_epoch']}), {fit['seconds']:.0f} s", layer_table(fit)]
    bounds = oracle_bounds(runs)
    if bounds:
        rows = [[model, cal, fmt(ratio)] for model, per in bounds.items() for cal, ratio in per.items()]
        parts += ["### Oracle bound (FLOPs ratio if every token exited at its oracle depth)",
                  markdown_table(["model", "calibration (+readout)", "oracle FLOPs ratio"], rows)]
    parts += ["### Frontier shift", frontier_shift(family_verdicts)]
    return "\n\n".join(parts)
