"""tools/results_numbers.py: the numbers README.md and docs/results.md quote are reports/metrics.json's, rendered into
marked blocks; `--check` names a stale block, a missing key is named, and the prose outside the blocks quotes none
of metrics.json's numbers."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import results_numbers  # noqa: E402

METRICS = ROOT / "reports" / "metrics.json"
DOCS = [ROOT / d for d in results_numbers.DOCS]
FORMATS = {"perplexity_change_at_target": results_numbers.multiple,  # how the blocks quote each key
           "max_reduction_within_tolerance": results_numbers.percent,
           "max_reduction_unresolved": results_numbers.percent,
           "speedup": lambda v: f"{v:.2f}×"}


def _copies(tmp_path: Path, change=None) -> tuple[list[str], list[Path]]:
    """Flags for the tool on copies of the docs and of metrics.json (``change(metrics)`` edits it first)."""
    metrics = json.loads(METRICS.read_text())
    if change:
        change(metrics)
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    docs = []
    for doc in DOCS:
        docs.append(tmp_path / doc.name)
        shutil.copy(doc, docs[-1])
    return ["--metrics", str(tmp_path / "metrics.json"), "--params", str(ROOT / "params.yaml"), *map(str, docs)], docs


def _control(metrics: dict) -> dict:
    return metrics["smollm2-135m+idle15"]


def test_the_committed_docs_hold_what_metrics_json_gives(capsys):
    assert results_numbers.main(["--check"]) == 0, capsys.readouterr().err
    names = {m["name"] for doc in DOCS for m in results_numbers.BLOCK.finditer(doc.read_text())}
    assert {"glance", "verdict:smollm2-135m", "families:smollm2-135m"} <= names


def test_a_changed_number_makes_check_fail_naming_its_blocks(tmp_path, capsys):
    def change(metrics):
        _control(metrics)["fixed"]["max_reduction_within_tolerance"] = 0.3

    flags, docs = _copies(tmp_path, change)
    before = [doc.read_text() for doc in docs]
    assert results_numbers.main(["--check", *flags]) == 1
    err = capsys.readouterr().err
    for block in ("reduction:smollm2-135m+idle15:fixed", "families:smollm2-135m+idle15", "glance"):
        assert f"block {block} is stale" in err, err
    assert [doc.read_text() for doc in docs] == before  # --check changes nothing


def test_rendering_rewrites_only_the_blocks(tmp_path):
    def change(metrics):
        _control(metrics)["fixed"]["max_reduction_within_tolerance"] = 0.3

    flags, docs = _copies(tmp_path, change)
    before = [doc.read_text() for doc in docs]
    assert results_numbers.main(flags) == 0
    after = [doc.read_text() for doc in docs]
    assert "saves <!-- numbers:begin reduction:smollm2-135m+idle15:fixed -->30.0%<!--" in after[1]
    assert [results_numbers.BLOCK.sub("", t) for t in after] == [results_numbers.BLOCK.sub("", t) for t in before]
    assert results_numbers.main(["--check", *flags]) == 0


@pytest.mark.parametrize(("change", "named"), [
    (lambda m: m["smollm2-135m"]["fixed"].pop("c1"), "smollm2-135m → fixed has no key 'c1'"),
    (lambda m: _control(m)["fixed"].pop("max_reduction_within_tolerance"),
     "smollm2-135m+idle15 → fixed has no key 'max_reduction_within_tolerance'"),
    (lambda m: m.pop("smollm2-135m+idle15"), "no model 'smollm2-135m+idle15'"),
    (lambda m: m["smollm2-135m"].pop("emad (all)"), "smollm2-135m has no entry 'emad (all)' for the judged method"),
])
def test_a_key_missing_from_metrics_json_is_named(change, named, tmp_path, capsys):
    flags, _ = _copies(tmp_path, change)
    assert results_numbers.main(["--check", *flags]) == 2
    assert named in capsys.readouterr().err


def test_the_prose_outside_the_blocks_quotes_no_number_of_metrics_json():
    quoted = {fmt(value) for per_model in json.loads(METRICS.read_text()).values() for headline in per_model.values()
              for key, fmt in FORMATS.items() if (value := headline.get(key)) is not None}
    for doc in DOCS:
        prose = results_numbers.BLOCK.sub("", doc.read_text())
        found = sorted(q for q in quoted if re.search(rf"(?<![\d.]){re.escape(q)}(?![\d])", prose))
        assert not found, f"{doc.name} quotes {found} outside a numbers block: put them in one (tools/results_numbers.py)"


def test_the_speedup_block_quotes_c2s_timed_point_with_its_interval_over_prompts():
    timed = {"c1": "pass", "c2": "pass", "c2_point": "fixed_30", "speedup": 1.3912, "speedup_lo": 1.3801,
             "speedup_hi": 1.4107, "speedup_prompts": 8, "speedup_level": 0.975}
    m = results_numbers.Metrics({"ctl": {"emad (all)": timed, "fixed": timed, "emad": {"c1": "fail", "c2": "fail"}}},
                                "metrics.json")
    assert results_numbers.render("speedup:ctl:fixed", m) == "1.39× (97.5% CI 1.38 to 1.41, 8 prompts)"
    rows = results_numbers.families_table(m, "ctl").splitlines()
    assert rows[0].endswith("| speed-up of C2's point |")
    assert rows[-1].endswith("| 1.39× (97.5% CI 1.38 to 1.41, 8 prompts), `fixed_30` |")  # `fixed`
    assert next(r for r in rows if r.startswith("| `emad` |")).endswith("| — |")  # not timed: no number
    with pytest.raises(results_numbers.MissingNumber, match="ctl → emad has no key 'speedup'"):
        results_numbers.render("speedup:ctl:emad", m)


def test_a_powered_block_reads_the_powered_record(tmp_path, monkeypatch):
    """A ``powered/`` block renders the powered run's metrics.json with its own params (target, control), apart from
    the default run's; an unknown record is named."""
    powered = json.loads(METRICS.read_text())
    model = next(iter(powered))
    judged = results_numbers.load(METRICS, ROOT / "params.yaml").judged(model)
    powered[model][judged]["c1"], powered[model][judged]["c1_reason"] = "pass", "met"
    (tmp_path / "powered.json").write_text(json.dumps(powered))
    monkeypatch.setitem(results_numbers.RECORDS, "powered", (str(tmp_path / "powered.json"),
                                                             str(ROOT / "params-powered.yaml")))
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- numbers:begin glance --><!-- numbers:end glance -->\n"
                   "<!-- numbers:begin powered/glance --><!-- numbers:end powered/glance -->\n")
    assert results_numbers.main(["--metrics", str(METRICS), "--params", str(ROOT / "params.yaml"), str(doc)]) == 0
    default, pow_ = re.findall(r"numbers:begin (?:powered/)?glance -->(.*?)<!--", doc.read_text(), re.S)
    assert f"**{model}: C1 passes" in pow_ and f"**{model}: C1 passes" not in default
    doc.write_text("<!-- numbers:begin nowhere/glance --><!-- numbers:end nowhere/glance -->\n")
    assert results_numbers.main(["--metrics", str(METRICS), "--params", str(ROOT / "params.yaml"), str(doc)]) == 2
