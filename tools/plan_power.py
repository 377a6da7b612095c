"""Which checks a plan (a params file) can decide at its sizes under the verdict's rules — computed from the plan,
not run. Per domain and metric: the judged units (the confirmation half of each task's units), what a "met" needs
and whether the plan has it:

- a score in [0, 1] with every judged unit equal: at least ``needs`` units (``1 − ((1 − level)/2)^(1/n) ≤ 1 point``
  at the level the check is judged at: 95% with one candidate, 1 − 0.05/m with m);
- a change shown by a bootstrap interval (perplexity always: equal windows bound no relative change; the other
  bootstrap metrics where units differ): a size at which the interval's upper bound covers
  (reports/bench/coverage.json, :mod:`emad.evaluation.coverage`);
- C2: its prompts per domain, where the Student-t interval's lower bound covers.

    python tools/plan_power.py [params.yaml] [--coverage reports/bench/coverage.json] [--candidates 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from emad.evaluation.checks import MIN_UNITS, Thresholds  # noqa: E402
from emad.evaluation.coverage import SPEED, Coverage  # noqa: E402
from emad.evaluation.intervals import LEVEL  # noqa: E402
from emad.evaluation.metrics import METRICS  # noqa: E402
from emad.params import validate_params  # noqa: E402

BOOTSTRAPPED = {"perplexity", "agreement.token_agreement", "fidelity.token_agreement", "fidelity.rouge_l"}


def judged_units(cfg: dict, domain: str) -> dict[str, int]:
    """Per metric of ``domain``'s tasks: the units the verdict judges (the confirmation half; a token-level metric's
    prompts)."""
    decode, corpus = cfg["decode"], cfg["corpus"]
    out = {}
    for task in decode.domains[domain]:
        settings = decode.tasks.get(task, {})
        if task == "perplexity":
            out["perplexity"] = settings["tokens"] // (settings["window"] - settings["prefix"]) // 2
        elif task in ("agreement", "fidelity"):
            out |= {m.name: settings["prompts"] // 2 for m in METRICS.values() if m.task == task}
        elif task in ("cloze", "choice"):
            items = getattr(corpus.tasks, task).items // 2
            out |= {m.name: items for m in METRICS.values() if m.task == task}
    return out


def rows(cfg: dict, table: Coverage, candidates: int = 1) -> list[dict]:
    """One row per domain and check: judged units, what met needs, whether the plan can decide it."""
    thr, level = Thresholds(), 1.0 - (1.0 - LEVEL) / candidates
    out = []
    for domain in cfg["decode"].domains:
        for metric, n in sorted(judged_units(cfg, domain).items()):
            m = METRICS.get(metric)
            needs = m.needs(thr.tolerance(metric), level)
            covers = (table.trusted(metric, "bootstrap", n, "upper") if metric in BOOTSTRAPPED else None)
            covers_from = table.needs(metric, "bootstrap", "upper") if metric in BOOTSTRAPPED else None
            if n < MIN_UNITS:
                verdict = f"not counted (n < {MIN_UNITS})"
            elif needs is None:  # perplexity: only a paired interval that covers meets it
                verdict = "decidable" if covers else f"underpowered: its interval covers from n {covers_from}"
            elif n < needs:
                verdict = f"underpowered: needs {needs} {m.sampled}s"
            else:
                verdict = "decidable"
            out.append({"domain": domain, "check": metric, "judged": n, "unit": m.sampled, "needs_equal": needs,
                        "bootstrap_covers": covers, "bootstrap_covers_from": covers_from, "verdict": verdict})
        prompts = cfg["decode"].speed_prompts
        speed = table.trusted(SPEED, "t-log", prompts, "lower")
        out.append({"domain": domain, "check": "C2 speed-up", "judged": prompts, "unit": "prompt", "needs_equal": None,
                    "bootstrap_covers": speed, "bootstrap_covers_from": table.needs(SPEED, "t-log", "lower"),
                    "verdict": "decidable" if speed else "underpowered: its interval does not cover"})
    return out


def markdown(found: list[dict]) -> str:
    lines = ["| domain | check | judged units | met with every unit equal needs | its interval covers (the side "
             "a pass rests on) | decidable? |", "|---|---|---|---|---|---|"]
    for r in found:
        needs = "—" if r["needs_equal"] is None else f"{r['needs_equal']} {r['unit']}s"
        covers = ("—" if r["bootstrap_covers"] is None else
                  ("yes" if r["bootstrap_covers"] else "no") + (f" (from n {r['bootstrap_covers_from']})"
                                                                if r["bootstrap_covers_from"] else " (at no size)"))
        lines.append(f"| {r['domain']} | {r['check']} | {r['judged']} {r['unit']}s | {needs} | {covers} | "
                     f"{r['verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("params", nargs="?", default=str(ROOT / "params.yaml"))
    parser.add_argument("--coverage", default=str(ROOT / "reports" / "bench" / "coverage.json"))
    parser.add_argument("--candidates", type=int, default=1, help="candidates one claim rests on (Bonferroni)")
    args = parser.parse_args(argv)
    if args.candidates < 1:
        parser.error(f"--candidates must be >= 1, got {args.candidates}")
    print(markdown(rows(validate_params(args.params), Coverage.load(args.coverage), args.candidates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
