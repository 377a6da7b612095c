"""The measured numbers that README.md and docs/results.md quote, rendered from reports/metrics.json.

Each number or passage lives in a marked block; the text between the markers is this tool's, the prose around it
the author's::

    <!-- numbers:begin families:smollm2-135m -->
    ... (written by this tool) ...
    <!-- numbers:end families:smollm2-135m -->

A block's name is ``[<record>/]<kind>[:<model>[:<family>]]`` (model and family as keys of metrics.json); a
``powered/`` block reads the powered run's record (reports/powered/metrics.json, with params-powered.yaml's target,
control and methods) instead of the default run's:

- ``glance``: the verdict of every model in a few lines (README).
- ``verdict:<model>``: a model's verdict, its families grouped by outcome, perplexity at the C1 target.
- ``families:<model>``: the table of a model's families (C1, C2, perplexity at the target, largest reductions).
- ``reduction:<model>:<family>``: inline, the largest FLOPs reduction with every check met (``28.1%``).
- ``perplexity:<model>:<family>``: inline, perplexity at the target as a multiple of full depth's (``×8.4``).
- ``speedup:<model>:<family>``: inline, the speed-up of the point C2 names with its interval over prompts
  (``1.39× (95% CI 1.38 to 1.41, 8 prompts)``).

    python tools/results_numbers.py            # rewrite the blocks (make repro runs it after dvc repro)
    python tools/results_numbers.py --check    # exit 1 naming each stale block; the files are left alone

A key the blocks need that metrics.json lacks is an error naming it (exit 2). The C1 target (``15%``) and the
control's name come from params.yaml.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/results.md")
BLOCK = re.compile(r"<!-- numbers:begin (?P<name>\S+) -->(?P<body>.*?)<!-- numbers:end (?P<end>\S+) -->", re.S)
OUTCOME = {"pass": "passes", "fail": "fails (falsified)", "unresolved": "is unresolved",
           "untested": "is not falsified; untested at this size"}
GROUPS = [(("pass", "pass", None), "C1 and C2 pass"), (("pass", "unresolved", None), "C1 passes, C2 is unresolved"),
          (("pass", "untested", None), "C1 passes, C2 is untested at this size"),
          (("pass", None, None), "C1 passes, C2 fails"),
          (("untested", None, "short"), "C1 untested: no point reaches {target} fewer FLOPs"),
          (("untested", None, None), "C1 is not falsified but untested at this size"),
          (("unresolved", None, None), "C1 is unresolved"),
          (("fail", "fail", None), "C1 and C2 fail"), ((None, None, None), "C1 fails")]  # (C1, C2, C1's reason);
# None: any other
DEFAULT_TARGET = 0.15  # aggregate.min_flops_reduction when params.yaml leaves it out (its model's default)
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


class MissingNumber(KeyError):
    """A key the blocks need is not in metrics.json."""

    def __str__(self) -> str:
        return self.args[0]


class Metrics:
    """reports/metrics.json (``{model: {family: headline}}``) read with errors that name the missing key."""

    def __init__(self, data: dict, source: str, target: float = DEFAULT_TARGET, control: str | None = None,
                 methods: tuple[str, ...] = ("emad",)):
        self.data, self.source, self.target, self.control, self.methods = data, source, target, control, methods

    def models(self) -> list[str]:
        return list(self.data)

    def families(self, model: str) -> dict[str, dict]:
        """Every family judged alone (the judged method's joined entry left out)."""
        judged = self.judged(model)
        return {f: h for f, h in self._model(model).items() if f != judged}

    def judged(self, model: str) -> str:
        """The entry of the judged method: ``emad (all)`` (``emad, confidence`` for several), or its one family."""
        joined = f"{self.methods[0]} (all)" if len(self.methods) == 1 else ", ".join(self.methods)
        entries = self._model(model)
        if joined in entries:
            return joined
        own = [f for f in entries if method_of(f) in self.methods]
        if len(own) == 1:
            return own[0]
        raise MissingNumber(f"{self.source}: {model} has no entry {joined!r} for the judged method (aggregate.methods)")

    def get(self, model: str, family: str, key: str) -> Any:
        headline = self.headline(model, family)
        if key not in headline:
            raise MissingNumber(f"{self.source}: {model} → {family} has no key {key!r} (it has: "
                                f"{', '.join(headline) or 'none'})")
        return headline[key]

    def optional(self, model: str, family: str, key: str) -> Any:
        return self.headline(model, family).get(key)

    def _model(self, model: str) -> dict:
        if model not in self.data:
            raise MissingNumber(f"{self.source}: no model {model!r} (models: {', '.join(self.data) or 'none'})")
        return self.data[model]

    def headline(self, model: str, family: str) -> dict:
        """The headline of one family of one model (errors name the missing model or family)."""
        if family not in self._model(model):
            raise MissingNumber(f"{self.source}: {model} has no family {family!r}")
        return self._model(model)[family]


def method_of(family: str) -> str:
    """The method of a family name ``method[+readout][:estimator][/stride]``."""
    return re.split(r"[+:/]", family, maxsplit=1)[0]


# ------------------------------------------------------------------ formats

def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def target(x: float) -> str:
    """The C1 target as the docs write it: ``15%``."""
    return f"{100 * x:.1f}".rstrip("0").rstrip(".") + "%"


def multiple(change: float) -> str:
    """A relative change (ratio − 1) as a multiple of full depth's value: ``×8.4``, ``×3.0·10⁶``."""
    ratio = 1.0 + change
    if ratio < 1000:
        return f"×{ratio:.1f}"
    exponent = math.floor(math.log10(ratio))
    return f"×{ratio / 10 ** exponent:.1f}·10{str(exponent).translate(SUPERSCRIPT)}"


def speedup(headline: dict) -> str:
    """The speed-up C2 read, with its interval over prompts: ``1.39× (95% CI 1.38 to 1.41, 8 prompts)``."""
    value, n = headline["speedup"], headline.get("speedup_prompts")
    lo, hi, level = headline.get("speedup_lo"), headline.get("speedup_hi"), headline.get("speedup_level")
    ci = (f"{100 * level:.4g}% CI {lo:.2f} to {hi:.2f}" if None not in (lo, hi, level) else "CI n/a")
    return f"{value:.2f}× ({ci}, {n} prompts)"


def code(name: str) -> str:
    """A family as the docs write it: in code, but a joined name with blanks (``emad (all)``) in quotes."""
    return f'"{name}"' if " " in name else f"`{name}`"


# ------------------------------------------------------------------ blocks

def families_table(m: Metrics, model: str) -> str:
    """A model's families: C1, C2, perplexity at the target, largest reductions (met; unresolved)."""
    rows = [f"| family | C1 | C2 | perplexity at {target(m.target)} fewer FLOPs | largest reduction, every check met | "
            f"largest reduction, unresolved | speed-up of C2's point |", "|---|---|---|---|---|---|---|"]
    for family in [m.judged(model), *sorted(m.families(model))]:
        cells = [code(family), *(_outcome(m.get(model, family, c), m.optional(model, family, f"{c}_reason"))
                                 for c in ("c1", "c2"))]
        for key, fmt in (("perplexity_change_at_target", multiple), ("max_reduction_within_tolerance", percent),
                         ("max_reduction_unresolved", percent)):
            value = m.optional(model, family, key)
            cells.append("—" if value is None else fmt(value))
        timed = m.optional(model, family, "speedup") is not None
        cells.append(f"{speedup(m.headline(model, family))}, {code(m.get(model, family, 'c2_point'))}" if timed else "—")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _outcome(outcome: str, reason: str | None) -> str:
    """``untested (short)``: an outcome with the reason the decision table gave it."""
    return outcome if not reason else f"{outcome} ({reason})"


def _grouped(m: Metrics, model: str) -> list[str]:
    """``C1 and C2 pass: `fixed` (28.1%), ...`` per outcome group of the families judged alone."""
    families, out, placed = m.families(model), [], set()
    for (c1, c2, reason), label in GROUPS:
        members = [f for f in sorted(families) if f not in placed and c1 in (None, m.get(model, f, "c1"))
                   and c2 in (None, m.get(model, f, "c2")) and reason in (None, m.optional(model, f, "c1_reason"))]
        placed |= set(members)
        if members:
            out.append((label.format(target=target(m.target)), members))
    if len(out) == 1 and len(out[0][1]) > 1:
        return [f"all {len(families)} families judged alone: {out[0][0]}"]
    return [f"{label}: " + ", ".join(_with_reduction(m, model, f) for f in members) for label, members in out]


def _with_reduction(m: Metrics, model: str, family: str) -> str:
    """`family` and, when it has one, its largest FLOPs reduction with every check met."""
    reduction = m.optional(model, family, "max_reduction_within_tolerance")
    return code(family) + ("" if reduction is None else f" ({percent(reduction)})")


def _perplexities(m: Metrics, model: str) -> str | None:
    """Perplexity at the target for EMAD at its best and for the best family (None: no curve reaches it)."""
    changes = {f: m.optional(model, f, "perplexity_change_at_target") for f in m.families(model)}
    changes = {f: v for f, v in changes.items() if v is not None}
    if not changes:
        return None
    best = min(changes, key=changes.get)
    own = {f: v for f, v in changes.items() if method_of(f) in m.methods}
    parts = []
    if own:
        mine = min(own, key=own.get)
        parts.append(f"{multiple(own[mine])} full depth's for {m.methods[0].upper()} at its best ({code(mine)})")
    if not own or best != min(own, key=own.get):
        whose = "" if own else " full depth's"
        parts.append(f"{multiple(changes[best])}{whose} for the best family ({code(best)})")
    return f"at {target(m.target)} fewer FLOPs perplexity is " + " and ".join(parts)


def verdict(m: Metrics, model: str) -> str:
    """A model's verdict in a paragraph: the judged method's outcomes, the families by outcome, perplexity."""
    judged = m.judged(model)
    role = " (the positive control)" if model == m.control else ""
    head = (f"**{model}{role}: C1 {OUTCOME[m.get(model, judged, 'c1')]} and C2 "
            f"{OUTCOME[m.get(model, judged, 'c2')]}** for {code(judged)}")
    reduction = m.optional(model, judged, "max_reduction_within_tolerance")
    if reduction is not None:
        head += f" (largest FLOPs reduction with every check met: {percent(reduction)})"
    lines = [head + ".", *(f"{line[0].upper()}{line[1:]}." for line in _grouped(m, model))]
    perplexity = _perplexities(m, model)
    if perplexity:
        lines.append(f"{perplexity[0].upper()}{perplexity[1:]}.")
    return " ".join(lines)


def glance(m: Metrics) -> str:
    """Every model's verdict, one bullet each."""
    return "\n".join(f"- {verdict(m, model)}" for model in m.models())


def render(name: str, m: Metrics) -> str:
    """The text of block ``name`` (multi-line blocks start and end with a newline)."""
    kind, *args = name.split(":", 2)
    blocks: dict[str, Callable[..., str]] = {"glance": glance, "verdict": verdict, "families": families_table}
    inline = {"reduction": ("max_reduction_within_tolerance", percent),
              "perplexity": ("perplexity_change_at_target", multiple)}
    if kind == "speedup" and len(args) == 2:
        m.get(*args, "speedup")  # an error naming the key when C2 timed no point of this family
        return speedup(m.headline(*args))
    if kind in inline and len(args) == 2:
        key, fmt = inline[kind]
        return fmt(m.get(*args, key))
    if kind in blocks and len(args) == (0 if kind == "glance" else 1):
        return f"\n{blocks[kind](m, *args)}\n"
    raise ValueError(f"unknown numbers block {name!r}; kinds: glance, verdict:<model>, families:<model>, "
                     f"reduction:<model>:<family>, perplexity:<model>:<family>, speedup:<model>:<family>")


RECORDS = {"powered": ("reports/powered/metrics.json", "params-powered.yaml")}  # record -> its metrics and params


def rendered(text: str, m: Metrics, where: str, records: dict[str, Metrics] | None = None) -> tuple[str, list[str]]:
    """``text`` with every block rendered (a ``<record>/`` block from ``records``, loaded on first use from
    :data:`RECORDS`), and the names of the blocks whose text changed."""
    stale, records = [], {} if records is None else records

    def one(match: re.Match) -> str:
        name = match["name"]
        if match["end"] != name:
            raise ValueError(f"{where}: block {name!r} ends with numbers:end {match['end']}")
        record, _, bare = name.rpartition("/")
        if record and record not in RECORDS:
            raise ValueError(f"{where}: block {name!r} names an unknown record {record!r}; records: "
                             f"{', '.join(RECORDS)}")
        if record and record not in records:
            records[record] = load(*(ROOT / part for part in RECORDS[record]))
        body = render(bare, records[record] if record else m)
        if body != match["body"]:
            stale.append(name)
        return f"<!-- numbers:begin {name} -->{body}<!-- numbers:end {name} -->"

    return BLOCK.sub(one, text), stale


def load(metrics: Path, params: Path) -> Metrics:
    """metrics.json with the C1 target, the control's name and the judged methods of params.yaml."""
    if not metrics.is_file():
        raise MissingNumber(f"{metrics} does not exist: run the pipeline (make repro) first")
    raw = yaml.safe_load(params.read_text(encoding="utf-8")) if params.is_file() else {}
    aggregate, control = raw.get("aggregate") or {}, raw.get("control") or {}
    return Metrics(json.loads(metrics.read_text(encoding="utf-8")), str(metrics),
                   aggregate.get("min_flops_reduction", DEFAULT_TARGET), control.get("model"),
                   tuple(aggregate.get("methods") or ("emad",)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help=f"documents (default: {', '.join(DOCS)})")
    parser.add_argument("--metrics", type=Path, default=ROOT / "reports" / "metrics.json")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    args = parser.parse_args(argv)
    try:
        m = load(args.metrics, args.params)
        records: dict[str, Metrics] = {}
        results = {path: rendered(path.read_text(encoding="utf-8"), m, str(path), records)
                   for path in args.files or [ROOT / d for d in DOCS]}
    except (MissingNumber, ValueError) as err:
        print(f"results_numbers: error: {err}", file=sys.stderr)
        return 2
    stale = [f"{path}: block {name} is stale" for path, (_, names) in results.items() for name in names]
    if args.check:
        for line in stale:
            print(f"results_numbers: {line} (rerun python tools/results_numbers.py)", file=sys.stderr)
        return 1 if stale else 0
    for path, (text, names) in results.items():
        if names:
            path.write_text(text, encoding="utf-8")
            print(f"results_numbers: {path}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
