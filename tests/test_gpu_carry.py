"""What a first GPU run carries (tools/gpu_carry.py, docs/pipeline.md's recipe): each of the two transfers stays
within 64 MiB with the checkout, the GGUF comes back whole (sha256 checked) from its two parts, a missing part is
named, and the recipe in the docs carries what the packer lists."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "tools" / "gpu_carry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_model_is_cut_so_that_both_transfers_fit_and_a_plan_that_cannot_fit_says_why():
    tool = _tool()
    first, totals = tool.plan(checkout=9 * MiB, site=2 * MiB, model=94 * MiB)
    assert sum(totals) == 2 * 9 * MiB + 2 * MiB + 94 * MiB and abs(totals[0] - totals[1]) <= 1
    assert max(totals) <= tool.LIMIT - tool.MARGIN and 0 < first < 94 * MiB
    with pytest.raises(ValueError, match=r"two transfers cannot carry it: checkout 30.0 MiB, site 2.0 MiB, model "
                                         r"94.0 MiB make transfers of 78.0 and 78.0 MiB, over 62.0 MiB"):
        tool.plan(checkout=30 * MiB, site=2 * MiB, model=94 * MiB)


@pytest.mark.slow
def test_pack_then_join_gives_the_embedded_gguf_back_and_names_a_missing_part(tmp_path):
    tool = _tool()
    out = tmp_path / ".carry"
    manifest = tool.pack(out, tool.LIMIT)
    assert all(t["bytes"] <= tool.LIMIT - tool.MARGIN for t in manifest["transfers"])
    assert [[Path(p).name for p in t["carry"]] for t in manifest["transfers"]] == \
        [["site", "smollm2-135m.gguf.00"], ["smollm2-135m.gguf.01"]]
    assert (out / "site" / "gguf" / "__init__.py").is_file() and (out / "site" / "accelerate").is_dir()
    assert not any(".." in str(p.relative_to(out)) for p in out.rglob("*"))  # no package script outside the site
    joined = tool.join(out)
    assert tool.sha256(joined) == manifest["model_sha256"] == tool.sha256(tool.embedded_gguf())
    assert json.loads((out / "manifest.json").read_text()) == manifest
    (out / "model" / "smollm2-135m.gguf.00").unlink()
    with pytest.raises(SystemExit, match=r"missing .*smollm2-135m.gguf.00: the first part comes with transfer 1"):
        tool.join(out)


def test_the_docs_recipe_carries_what_the_packer_lists_and_runs_the_check_into_out():
    text = (ROOT / "docs" / "pipeline.md").read_text()
    assert '`[".carry/site", ".carry/model/smollm2-135m.gguf.00"]`' in text
    assert '`[".carry/model/smollm2-135m.gguf.01"]`' in text
    assert 'make gpu-check ARGS="--out-dir $OUT --budget 360"' in text
    assert "python3 tools/gpu_carry.py join && make gpu-check" in text
    makefile = (ROOT / "Makefile").read_text()
    assert ".carry/site" in makefile and "tools/gpu_carry.py pack" in makefile
