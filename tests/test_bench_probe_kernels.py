"""benchmarks/bench_probe_kernels.py: a compiled probe computes what its estimator needs and bookkeeping on [B]-sized
tensors, nothing more — no second final norm, no matrix product and no pass over the vocabulary beyond the minimum
(the NaN check comes from the entropy, the exit reads the probe's head input) — and the last probe, not estimated,
is full depth's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_probe_adds_no_norm_no_matmul_and_no_vocabulary_pass_to_its_estimators_minimum(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_probe_kernels", ROOT / "benchmarks" / "bench_probe_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr("common.OUT_DIR", tmp_path)
    result = bench.main(["--batches", "2", "--layers", "9", "--no-kernels", "--out", "probe-kernels-test"])
    assert json.loads((tmp_path / "probe-kernels-test.json").read_text()) == json.loads(json.dumps(result))
    (batch,) = result["batches"]
    assert set(batch["estimators"]) == {"exact", "topk", "lowrank"}
    for name, row in batch["estimators"].items():
        assert row["added"]["matmuls"] == row["added"]["final_norms"] == row["added"]["vocab_passes"] == 0, name
        assert row["probe"]["final_norms"] == 1 and row["last_probe_equals_full_depth"]
    assert batch["estimators"]["topk"]["probe"]["vocab_passes"] == 0  # a shortlist: no V-wide tensor at all
    assert batch["full_depth_probe"]["matmuls"] == 0  # the exit readout is made once, when the step finishes
