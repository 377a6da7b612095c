"""What each stage's start imports: a stage that touches no model starts without torch, and none imports mlflow
before it logs a run.

Each stage script of ``dvc.yaml`` is started in a fresh interpreter as DVC starts it (its command line, in the
project root) up to its first line of work (``tools/stage_start.py``: the script imported, its arguments parsed,
its params loaded). The heavy libraries then in ``sys.modules`` must be exactly the expected ones, so a later
import cannot bring one back silently, and one that leaves is noticed (and its entry here dropped).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.params_reads import ROOT
from tests.test_stage_params import instances

NO_MODEL = ("sample_corpus", "smooth", "aggregate")
"""Stages that touch no model: they start with none of :data:`HEAVY`."""

EXPECTED = {
    "sample_corpus": set(),
    "smooth": set(),
    "aggregate": set(),
    "prepare_model": {"torch", "transformers"},  # it has no params: its start is its import
    "fit_readouts": {"torch", "transformers"},
    "calibrate": {"torch", "transformers"},
    "fit_estimators": {"torch", "transformers"},
    "decode": {"torch", "transformers"},
    "risk": {"torch", "transformers"},
}

def _first_instances() -> dict[str, tuple[str, ...]]:
    """One command line per stage script, as dvc.yaml gives it."""
    out: dict[str, tuple[str, ...]] = {}
    for instance in instances(ROOT):
        out.setdefault(instance.argv[1].removeprefix("pipeline/").removesuffix(".py"), instance.argv)
    return out


ARGV = _first_instances()


def started(script: str) -> set[str]:
    """The heavy libraries loaded once ``script`` has parsed its arguments and loaded its params."""
    done = subprocess.run([sys.executable, "tools/stage_start.py", *ARGV[script][1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{script}: {done.stderr[-2000:]}"
    return set(json.loads(done.stdout.strip().splitlines()[-1])["heavy"])


def test_every_stage_script_is_listed():
    assert set(ARGV) == set(EXPECTED), "a stage script without an expected import set (or one that left dvc.yaml)"


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_a_stage_starts_with_the_libraries_it_needs(script):
    loaded = started(script)
    assert "mlflow" not in loaded, f"{script} imports mlflow before it logs a run"
    if script in NO_MODEL:
        assert not loaded, f"{script} touches no model, but its start imports {sorted(loaded)}"
    assert loaded == EXPECTED[script], (f"{script}'s start imports {sorted(loaded)}, expected "
                                        f"{sorted(EXPECTED[script])}")


def test_sample_corpus_counts_with_the_models_tokenizer_without_torch():
    """Its tokenizer (the converted embedded model's ``tokenizer.json``, read as a fast tokenizer) has the
    fingerprint and token ids ``AutoTokenizer`` gives, and loading it imports no torch."""
    from transformers import AutoTokenizer

    from emad.engine.models import convert_embedded, model_cache_dir, tokenizer_sha256

    folder = convert_embedded("smollm2-135m", model_cache_dir() / "smollm2-135m")  # done once per host
    text = (ROOT / "README.md").read_text(encoding="utf-8")[:4000]
    code = ("import json, sys; sys.path.insert(0, 'pipeline'); from sample_corpus import load_tokenizer, "
            "token_counter; from emad.engine.fingerprint import tokenizer_sha256; "
            "tok = load_tokenizer('smollm2-135m'); text = sys.stdin.read(); "
            "print(json.dumps([tokenizer_sha256(tok), tok.backend_tokenizer.encode(text, add_special_tokens=False)"
            ".ids, token_counter(tok)(text), 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input=text, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    sha, ids, count, torch_loaded = json.loads(done.stdout.strip().splitlines()[-1])
    reference = AutoTokenizer.from_pretrained(folder)
    assert sha == tokenizer_sha256(reference)
    assert ids == reference(text, add_special_tokens=False)["input_ids"] and count == len(ids)
    assert not torch_loaded


def test_a_check_without_the_points_imports_no_torch_and_checks_every_other_section(tmp_path):
    """``points=False`` (the stages that touch no model): no torch; every other section still checked, an unknown
    section still refused; the operating points' sections are checked by every stage that loads a model."""
    import yaml

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    bad_point = {**raw, "decode": {**raw["decode"], "points": {"x": {"method": "no-such-method"}}}}
    bad_corpus = {**raw, "corpus": {**raw["corpus"], "seed": "zero"}}
    for name, values in (("bad_point", bad_point), ("bad_corpus", bad_corpus), ("bad_section", {**raw, "decod": 1})):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(values))
    code = ("import sys; from emad.params import validate_params; from emad.config import ConfigError\n"
            "validate_params('params.yaml', points=False); validate_params(sys.argv[1] + '/bad_point.yaml', "
            "points=False)\nfor name in ('bad_corpus', 'bad_section'):\n"
            "    try: validate_params(f'{sys.argv[1]}/{name}.yaml', points=False)\n"
            "    except ConfigError as err: print(name, err)\n"
            "    else: raise SystemExit(f'{name} passed')\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "corpus.seed" in done.stdout and "unknown section(s) decod" in done.stdout
    from emad.config import ConfigError
    from emad.params import validate_params

    with pytest.raises(ConfigError, match="no-such-method"):
        validate_params(tmp_path / "bad_point.yaml")
