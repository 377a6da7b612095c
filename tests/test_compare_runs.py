"""tools/compare_runs.py: equal outputs up to timings and provenance pass; any other difference is named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import compare_runs  # noqa: E402


def _checkout(root: Path, perplexity: float, seconds: float, host: str) -> Path:
    run = {"run_id": "m--p--d", "quality": {"perplexity": perplexity},
           "cost": {"flops_ratio": 0.8, "speedup": 1.0 + seconds, "seconds": seconds,
                    "speed_device": f"cpu: {host}"},
           "provenance": {"host": host}, "mlflow_run_id": host}
    (root / "reports" / "runs" / "m--decode").mkdir(parents=True)
    (root / "reports" / "runs" / "m--decode" / "m--p--d.json").write_text(json.dumps(run))
    (root / "data" / "profiles").mkdir(parents=True)
    (root / "data" / "profiles" / "profile.json").write_text('{"tau": [1.0]}')
    return root


def test_timings_and_provenance_aside_equal_outputs_compare_equal(tmp_path, capsys):
    a = _checkout(tmp_path / "a", 12.5, 1.0, "serial")
    b = _checkout(tmp_path / "b", 12.5, 9.0, "ray-node")
    assert compare_runs.main([str(a), str(b)]) == 0


def test_a_changed_number_or_a_missing_file_is_named(tmp_path, capsys):
    a = _checkout(tmp_path / "a", 12.5, 1.0, "serial")
    b = _checkout(tmp_path / "b", 12.6, 1.0, "serial")
    (b / "data" / "profiles" / "profile.json").unlink()
    assert compare_runs.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "differs: reports/runs/m--decode/m--p--d.json" in out and "only in one checkout: data/profiles/profile.json" in out
