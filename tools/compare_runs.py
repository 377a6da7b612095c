"""Compare the outputs of two checkouts that ran the pipeline (e.g. serial and Ray): every run file, screen and
risk result with its timings (the device they were timed on, and how many points shared a timed block: a decode
split over workers times each group's candidates apart), ``provenance`` and ``mlflow_run_id`` left out,
and the corpora, profiles and readouts byte for byte (PNG figures aside). Exit 1 when anything differs. With
``--common``, a key that only one side's record has is left out too (the outputs of two versions of the code, one
of which records more).

    python tools/compare_runs.py [--common] /path/to/serial-checkout /path/to/ray-checkout
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIMING = {"speedup", "speed_tokens_per_s", "reference_tokens_per_s", "speed_pairs", "load_avg", "seconds",
          "tokens_per_s", "scoring_seconds", "speed_repeats", "speed_new_tokens", "speed_unit",
          "speedup_by_reference", "reference_tokens_per_s_by_reference", "speed_reference", "decode_speedup",
          "decode_speed_pairs", "speed_device", "speed_block"}  # speed_block: how many points shared a timed block
LEFT_OUT = TIMING | {"provenance", "mlflow_run_id"}
RECORDS = ("reports/runs/**/*.json", "reports/risk/**/*.json")
BYTES = ("data/corpus/**/*", "data/profiles/**/*", "data/readouts/**/*")


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if k not in LEFT_OUT}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _common(a, b):
    """``a`` and ``b`` with the dict keys only one of them has left out, at every level."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = a.keys() & b.keys()
        pairs = {k: _common(a[k], b[k]) for k in keys}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = [_common(x, y) for x, y in zip(a, b)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return a, b


def _files(root: Path, pattern: str) -> dict[Path, Path]:
    return {p.relative_to(root): p for p in root.glob(pattern) if p.is_file() and p.suffix != ".png"}


def compare(a: Path, b: Path, common: bool = False) -> list[str]:
    """What differs between checkouts ``a`` and ``b`` (empty: nothing; ``common``: keys of one side only left out)."""
    out = []
    for pattern in RECORDS + BYTES:
        fa, fb = _files(a, pattern), _files(b, pattern)
        out += [f"only in one checkout: {rel}" for rel in sorted(set(fa) ^ set(fb))]
        for rel in sorted(set(fa) & set(fb)):
            if pattern in RECORDS or rel.name == "metrics.json":  # (a stage's metrics hold its training time)
                ja, jb = _clean(json.loads(fa[rel].read_text())), _clean(json.loads(fb[rel].read_text()))
                if common:
                    ja, jb = _common(ja, jb)
                same = ja == jb
            else:
                same = fa[rel].read_bytes() == fb[rel].read_bytes()
            if not same:
                out.append(f"differs: {rel}")
        print(f"{pattern}: {len(set(fa) & set(fb))} files compared", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    common = "--common" in args
    args = [a for a in args if a != "--common"]
    if len(args) != 2 or not all(Path(p).is_dir() for p in args):
        print(__doc__, file=sys.stderr)
        return 2
    diffs = compare(Path(args[0]), Path(args[1]), common)
    print("\n".join(diffs) if diffs else "no differences (timings and provenance aside)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
