"""Which checks a plan (a params file) can decide at its sizes under the verdict's rules — computed from the plan,
not run. Per domain and metric: the judged units (the confirmation half of each task's units) and whether each
label is reachable there — a *pass* (met) and a *failure* (violated) — at the level the check is judged at (95%
with one candidate, 1 − 0.05/m with ``--candidates`` m):

- met, a score in [0, 1] with every judged unit equal: at least ``needs`` units (``1 − ((1 − level)/2)^(1/n) ≤
  1 point``);
- met, a change shown by a bootstrap interval (perplexity always: equal windows bound no relative change; the other
  bootstrap metrics where units differ): a simulated level at which the interval's upper side covers at that size
  in every bin of changed units (reports/bench/coverage.json, :mod:`emad.evaluation.coverage`; the level it is then
  judged at is given);
- violated: an exact interval (0/1 scores) always; a bootstrap where its lower side covers, as above;
- C2: its prompts per domain, where the Student-t interval's lower side (a pass) or upper side (a failure) covers.

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


def _side(table: Coverage, metric: str, method: str, n: int, side: str, level: float) -> tuple[int, float] | None:
    """:meth:`emad.evaluation.coverage.Coverage.reach`."""
    return table.reach(metric, method, n, side, level)


def _reach(found: tuple[int, float] | None, level: float, covers_from: int | None) -> str:
    if found is None:
        return "no: its interval does not cover" + (f" (it does from n {covers_from})" if covers_from else "")
    changed, at = found
    where = "" if changed <= 1 else f" where ≥ {changed} units changed"
    return "yes" + where + ("" if at <= level + 1e-9 else f", judged at up to {100 * at:.4g}%")


def _met(n: int, needs: int | None, unit: str, found: tuple[int, float] | None, boot: bool, level: float,
         covers_from: int | None) -> str:
    """Whether a pass can be shown over ``n`` judged units: every unit equal and ``n ≥ needs`` (a score's share
    bound), or, where units changed, a bootstrap whose upper side covers (:func:`_side`)."""
    ways = []
    if needs is not None and n >= needs:
        ways.append(f"with every {unit} equal")
    if boot and found is not None:
        ways.append("by its bootstrap" + _reach(found, level, None).removeprefix("yes"))
    if ways:
        return "yes, " + "; or ".join(ways)
    why = [] if needs is None else [f"needs {needs} {unit}s with every one equal"]
    if boot:
        why.append("its interval does not cover" + (f" (it does from n {covers_from})" if covers_from else ""))
    return "no: " + "; ".join(why)


def rows(cfg: dict, table: Coverage, candidates: int = 1) -> list[dict]:
    """One row per domain and check: judged units and whether a pass (met) and a failure (violated) are decidable
    at the plan's sizes, each judged at 1 − 0.05/``candidates``."""
    thr, level = Thresholds(), 1.0 - (1.0 - LEVEL) / candidates
    out = []
    for domain in cfg["decode"].domains:
        for metric, n in sorted(judged_units(cfg, domain).items()):
            m = METRICS.get(metric)
            needs = m.needs(thr.tolerance(metric), level)
            boot = metric in BOOTSTRAPPED
            met_at = _side(table, metric, "bootstrap", n, "upper", level) if boot else None
            fail_at = _side(table, metric, "bootstrap", n, "lower", level) if boot else (0, level)
            if n < MIN_UNITS:
                met = failure = f"not counted (n < {MIN_UNITS})"
            else:
                met = _met(n, needs, m.sampled, met_at if boot else None, boot, level,
                           table.needs(metric, "bootstrap", "upper", level) if boot else None)
                failure = _reach(fail_at, level, table.needs(metric, "bootstrap", "lower", level)) if boot else "yes"
            out.append({"domain": domain, "check": metric, "judged": n, "unit": m.sampled, "needs_equal": needs,
                        "level": level, "met": met, "violated": failure})
        prompts = cfg["decode"].speed_prompts
        out.append({"domain": domain, "check": "C2 speed-up", "judged": prompts, "unit": "prompt", "needs_equal": None,
                    "level": level,
                    "met": _reach(_side(table, SPEED, "t-log", prompts, "lower", level), level,
                                  table.needs(SPEED, "t-log", "lower", level)),
                    "violated": _reach(_side(table, SPEED, "t-log", prompts, "upper", level), level,
                                       table.needs(SPEED, "t-log", "upper", level))})
    return out


def decidable(row: dict, label: str) -> bool:
    """Whether ``label`` (``met`` or ``violated``) can be reached at the row's size."""
    return row[label].startswith("yes")


def markdown(found: list[dict]) -> str:
    lines = ["| domain | check | judged units | met with every unit equal needs | a pass (met) decidable | "
             "a failure (violated) decidable |", "|---|---|---|---|---|---|"]
    for r in found:
        needs = "—" if r["needs_equal"] is None else f"{r['needs_equal']} {r['unit']}s"
        lines.append(f"| {r['domain']} | {r['check']} | {r['judged']} {r['unit']}s | {needs} | {r['met']} | "
                     f"{r['violated']} |")
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
