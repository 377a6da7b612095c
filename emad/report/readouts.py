"""The report's "Readouts" section: logit vs tuned readout per layer, the oracle bound under each, and how the
frontier moves when a family reads its layers through the tuned readout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from emad.evaluation.identity import LOGIT, family_of, split_family
from emad.report.frontier import oracle_bounds
from emad.report.tables import fmt, markdown_table
from emad.report.verdict import ModelVerdict

TUNED = "tuned"


def layer_table(fit: Mapping[str, Any]) -> str:
    """One row per layer: held-out top-1 agreement with layer L, KL to it and perplexity, logit vs tuned; the tuned
    readout's KL on the training, selection and held-out tokens; the epoch whose translator the layer kept (0: the
    identity; – at L, which is never translated) and why and when it stopped (– where the fit recorded none)."""
    held, best, stopped = fit["held_out"], fit.get("best_epoch"), fit.get("stopped") or {}
    final = max(held["logit"], key=int)
    rows = []
    for layer in sorted(held["logit"], key=int):
        lo, tu = held["logit"][layer], held["tuned"][layer]
        epoch = best.get(str(layer), best.get(int(layer))) if isinstance(best, Mapping) else best  # older: one epoch
        rows.append([str(layer), fmt(lo["agreement"]), fmt(tu["agreement"]), fmt(lo["kl"], ".2f"),
                     _kl(fit, "train_metrics", layer), _kl(fit, "selection_metrics", layer), fmt(tu["kl"], ".2f"),
                     fmt(lo["perplexity"], ".4g"), fmt(tu["perplexity"], ".4g"),
                     fmt(None if layer == final else epoch, "d"), _stop(stopped.get(str(layer)))])
    return markdown_table(["layer", "agreement (logit)", "agreement (tuned)", "KL (logit)", "KL (tuned) train",
                           "KL (tuned) selection", "KL (tuned) held-out", "perplexity (logit)",
                           "perplexity (tuned)", "best epoch", "stopped"], rows)


def _kl(fit: Mapping[str, Any], key: str, layer: str) -> str:
    """The tuned readout's KL at ``layer`` under ``key`` (``train_metrics`` or ``selection_metrics``); – where not
    recorded."""
    per = fit.get(key, {}).get(TUNED, {}).get(layer)
    return fmt(None if per is None else per["kl"], ".2f")


def _stop(stop: Mapping[str, Any] | None) -> str:
    """``patience @ 12``, ``cap @ 40`` or ``final state`` (never trained); – where the fit recorded none."""
    if stop is None:
        return "–"
    return stop["reason"] if stop["reason"] == "final state" else f"{stop['reason']} @ {stop['epoch']}"


def _closest(v: ModelVerdict) -> str:
    """C1's deciding point (:class:`~emad.report.verdict.C1Result`) with its reduction and its least certain check."""
    p = v.c1.deciding
    if p is None:
        return "–"
    worst = p.worst
    return f"{p.label}: {p.reduction:.1%} fewer FLOPs; " + (worst.describe() if worst else "no check")


def frontier_shift(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> str:
    """Per family with a tuned twin and model: C1's deciding point under each readout (its FLOPs reduction and
    its check furthest past or closest to the tolerance)."""
    rows = []
    def twin(family: str) -> str:
        method, _, estimator, stride = split_family(family)
        return family_of(method, TUNED, estimator, stride)

    for family in sorted(f for f in family_verdicts
                         if split_family(f)[1] == LOGIT and twin(f) in family_verdicts):
        for model, logit in sorted(family_verdicts[family].items()):
            tuned = family_verdicts[twin(family)].get(model)
            if tuned is None:
                continue
            rows.append([family, model, logit.c1.outcome, _closest(logit), tuned.c1.outcome, _closest(tuned)])
    if not rows:
        return "No family ran under both readouts."
    return markdown_table(["family", "model", "C1 (logit)", "deciding point (logit)", "C1 (tuned)",
                           "deciding point (tuned)"], rows)


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
             "(`logit`) or through the fitted translator first (`tuned`). Agreement = top-1 equal to layer L's. "
             "The tuned readout's KL also on its first training tokens and on the "
             "selection tokens, which chose each layer's epoch and stopped it (on patience: that many epochs "
             "without a lower selection KL; or at the epoch cap); held-out tokens choose nothing."]
    for name, fit in sorted(fits.items()):
        grown = (f" (the fit of `{fit['grown_from']}`, extended to the idle layers: what a fit here gives, bit for "
                 f"bit)") if fit.get("grown_from") else ""
        tokens = (f"{fit['tokens']} training (KL on the first {fit['train_reported']}), {fit['selection']} "
                  f"selection, {fit['holdout']} held-out tokens") if "selection" in fit else \
            f"{fit['tokens']} training tokens"
        parts += [f"### {name}: {tokens}, {len(fit['history'])} epochs, {fit['seconds']:.0f} s{grown}",
                  layer_table(fit)]
    bounds = oracle_bounds(runs)
    if bounds:
        rows = [[model, cal, fmt(ratio)] for model, per in bounds.items() for cal, ratio in per.items()]
        parts += ["### Oracle bound (FLOPs ratio if every token exited at its oracle depth)",
                  markdown_table(["model", "calibration (+readout)", "oracle FLOPs ratio"], rows)]
    parts += ["### Frontier shift", frontier_shift(family_verdicts)]
    return "\n\n".join(parts)
