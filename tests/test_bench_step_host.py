"""benchmarks/bench_step_host.py runs with tiny lengths: every decoder is timed on graphs replayed without device
work, and the JSON holds what docs/benchmarks.md reads."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy  # about a minute: a 30-layer model's segments compiled for four decoders
def test_the_step_host_benchmark_times_every_decoder_on_replayed_graphs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_step_host", ROOT / "benchmarks" / "bench_step_host.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr("common.OUT_DIR", tmp_path)
    result = bench.main(["--batches", "1", "--short", "2", "--long", "4", "--reps", "1", "--out", "step-host-test"])
    written = json.loads((tmp_path / "step-host-test.json").read_text())
    assert written == json.loads(json.dumps(result))
    (batch,) = written["batches"]
    assert written["probes_per_token"] == 10  # every 3rd of 30 layers
    assert set(batch["paths"]) == {"graph-if", "graph-lookahead", "host"}
    for path, rows in batch["paths"].items():
        assert set(rows) == {"full", "fixed-0.5L", "emad-probes-exact", "emad-probes-topk"}
        assert all(math.isfinite(row["ms_per_token"]) for row in rows.values())  # timings reported, not judged
        for name in ("emad-probes-exact", "emad-probes-topk"):
            assert math.isfinite(rows[name]["host_us_per_probe"])
            # counted, not timed: none per probe on the one-graph path, one per later probe on the lookahead path
            # and on the host step
            expected = {"graph-if": 0.0, "graph-lookahead": 0.9, "host": 0.9}[path]
            assert rows[name]["host_reads_per_probe"] == pytest.approx(expected)
        assert {row["step_path"] for row in rows.values()} == {"device/" + path if path != "host" else "host"}
    assert written["compile"]["graphs"] > 0  # the steps ran on captured graphs
