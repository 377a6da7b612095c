"""The ``emad`` console script: JSON output contract and errors that name the culprit."""

from __future__ import annotations

import json

import pytest

from emad.cli import main

pytestmark = pytest.mark.slow


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_has_the_contract_fields(smollm2, capsys, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("Once upon a time\nThe capital of France is\n")
    code, out, _ = _run(capsys, "generate", "--model", "smollm2-135m", "--batch-file", str(batch),
                        "--max-new-tokens", "6", "--method", "fixed", "--depth", "20", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert len(row["token_ids"]) == 6 and row["depths"] == [20] * 6
        assert isinstance(row["text"], str) and 0 < row["cost_ratio"] < 1
        assert row["method"] == {"method": "fixed", "depth": 20, "policy": "monotone", "estimator": "exact",
                                 "readout": "logit"}
        assert [t["depth"] for t in row["trace"]] == [20] * 6


def test_score_reports_nll_and_logprobs(smollm2, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.")
    code, out, _ = _run(capsys, "score", "--model", "smollm2-135m", "--text-file", str(text), "--json")
    assert code == 0
    result = json.loads(out)
    assert result["n_tokens"] == len(result["logprobs"]) == len(result["tokens"])
    assert result["nll"] == pytest.approx(-sum(result["logprobs"]))


@pytest.mark.parametrize("depth", ["0", "31"])
def test_depth_outside_range_is_an_error_naming_the_range(smollm2, capsys, depth):
    code, _, err = _run(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi", "--method", "fixed",
                        "--depth", depth)
    assert code == 2 and "1..30" in err


def test_fixed_without_depth_names_the_missing_flag(smollm2, capsys):
    code, _, err = _run(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi", "--method", "fixed")
    assert code == 2 and "depth" in err


def test_unknown_alias_lists_embedded_aliases(capsys):
    code, _, err = _run(capsys, "generate", "--model", "smolm2-135", "--prompt", "hi")
    assert code == 2 and "smolm2-135" in err and "smollm2-135m" in err


def test_missing_text_file_is_named(capsys, tmp_path):
    code, _, err = _run(capsys, "score", "--model", "smollm2-135m", "--text-file", str(tmp_path / "nope.txt"))
    assert code == 2 and "nope.txt" in err


def test_calibrate_then_profile_show(smollm2, capsys, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("Entropy measures uncertainty. A confident model has low entropy. " * 6)
    code, out, err = _run(capsys, "calibrate", "--model", "smollm2-135m", "--text-file", str(text), "--out",
                          str(tmp_path / "prof"), "--set", "calibrate.max_tokens=60", "--set", "calibrate.window=30",
                          "--set", "calibrate.probe_layers=10", "--set", "smooth.min_count=1")
    assert code == 0, err
    assert (tmp_path / "prof" / "stats.json").is_file()
    code, out, _ = _run(capsys, "profile", "show", str(tmp_path / "prof" / "profile.json"))
    assert code == 0
    assert "L10" in out and "L30" in out and "argmax = final" in out and "all" in out


def test_calibrate_bad_override_names_the_parameter(capsys, tmp_path):
    code, _, err = _run(capsys, "calibrate", "--model", "smollm2-135m", "--text-file", str(tmp_path / "x"),
                        "--out", str(tmp_path), "--set", "calibrate.windw=3")
    assert code == 2 and "calibrate.windw" in err


def test_an_unknown_engine_is_refused_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--model", "smollm2-135m", "--prompt", "x", "--engine", "jit"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--engine: invalid choice: 'jit'" in err and all(name in err for name in ("auto", "eager", "compiled"))
