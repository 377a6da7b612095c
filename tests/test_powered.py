"""The powered plan (params-powered.yaml) sizes every check the verdict counts to be decidable on the judged half of
its units, and the default plan says which of its checks are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from emad.evaluation.checks import MIN_UNITS, Thresholds
from emad.evaluation.metrics import METRICS
from emad.params import validate_params

ROOT = Path(__file__).resolve().parents[1]


def judged_units(cfg: dict, domain: str) -> dict[str, int]:
    """Per metric of ``domain``'s tasks: the judged units (the confirmation half) the share bound runs over — or,
    for perplexity, the judged windows."""
    decode, corpus = cfg["decode"], cfg["corpus"]
    out = {}
    for task in decode.domains[domain]:
        settings = decode.tasks.get(task, {})
        if task == "perplexity":
            windows = settings["tokens"] // (settings["window"] - settings["prefix"])
            out["perplexity"] = windows // 2
        elif task in ("agreement", "fidelity"):
            prompts = settings["prompts"] // 2
            for m in METRICS.values():
                if m.task == task:
                    out[m.name] = prompts * settings["new_tokens"] if m.unit == "token" else prompts
        elif task in ("cloze", "choice"):
            items = getattr(corpus.tasks, task).items // 2
            out |= {m.name: items for m in METRICS.values() if m.task == task}
    return out


def _needs(metric: str) -> int:
    thr = Thresholds()
    return METRICS.get(metric).needs(thr.tolerance(metric)) or MIN_UNITS


def test_every_counted_check_of_the_powered_plan_is_decidable():
    cfg = validate_params(ROOT / "params-powered.yaml")
    for domain in cfg["decode"].domains:
        units = judged_units(cfg, domain)
        assert {"perplexity", "fidelity.exact_match", "cloze.acc", "choice.acc"} <= set(units)
        short = {m: (n, _needs(m)) for m, n in units.items() if n < _needs(m)}
        assert not short, f"{domain}: judged units below what a check needs: {short}"


@pytest.mark.parametrize("metric, judged", [("perplexity", 8), ("agreement.token_agreement", 384),
                                            ("fidelity.exact_match", 12), ("cloze.acc", 8), ("choice.acc", 4)])
def test_the_default_plan_judges_these_units(metric, judged):
    """What docs/params.md says of the defaults: perplexity and agreement decidable, the per-prompt and per-item
    checks underpowered (reported as such)."""
    cfg = validate_params(ROOT / "params.yaml")
    assert judged_units(cfg, "stdlib-prose")[metric] == judged
