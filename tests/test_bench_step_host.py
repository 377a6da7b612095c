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
    rows = batch["decoders"]
    assert set(rows) == {"full", "fixed-0.5L", "emad-probes-exact", "emad-probes-topk"}
    assert batch["probes_per_token"] == 10  # every 3rd of 30 layers
    assert all(math.isfinite(row["ms_per_token"]) for row in rows.values())  # timings are reported, not judged
    assert all(math.isfinite(rows[n]["host_us_per_probe"]) for n in ("emad-probes-exact", "emad-probes-topk"))
    assert written["compile"]["graphs"] > 0  # the steps ran on captured graphs
