"""`dvc plots show` writes a page that renders with no network: the repo config points DVC at the committed
template .dvc/plots/offline.html, which inlines vega, vega-lite and vega-embed (pinned in
tools/build_plots_template.py) and leaves out the `{scripts}` placeholder that would add CDN <script src> tags."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from configobj import ConfigObj

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = REPO_ROOT / ".dvc" / "plots" / "offline.html"
BUILDER = REPO_ROOT / "tools" / "build_plots_template.py"

RECORDS = [
    {"point": point, "flops_ratio": ratio, "accuracy": acc, "f1": f1}
    for point, rows in {
        "baseline": [(1.0, 0.6174, 0.5512)],
        "entropy-guided": [(0.42, 0.5931, 0.5307), (0.61, 0.6102, 0.5449)],
    }.items()
    for ratio, acc, f1 in rows
]

# A user template: one series per value of the record field `point` (DVC has no plot property for that).
SERIES_TEMPLATE = {
    "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
    "data": {"values": "<DVC_METRIC_DATA>"},
    "title": "<DVC_METRIC_TITLE>",
    "mark": {"type": "line", "point": True},
    "encoding": {
        "x": {"field": "<DVC_METRIC_X>", "type": "quantitative", "title": "<DVC_METRIC_X_LABEL>"},
        "y": {"field": "<DVC_METRIC_Y>", "type": "quantitative", "title": "<DVC_METRIC_Y_LABEL>"},
        "color": {"field": "point", "type": "nominal"},
        "shape": "<DVC_METRIC_SHAPE>",
        "strokeDash": {"field": "rev", "type": "nominal"},
        "detail": {"field": "field", "type": "nominal"},
    },
}

DVC_YAML = """\
plots:
  - reports/frontier.json:
      x: flops_ratio
      y: accuracy
      template: scatter
  - quality_vs_flops:
      x: flops_ratio
      y:
        reports/frontier.json: [accuracy, f1]
      template: scatter
  - accuracy_by_point:
      x: flops_ratio
      y:
        reports/frontier.json: accuracy
      template: series
"""


def _builder():
    name = "build_plots_template"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BUILDER)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _dvc() -> str:
    exe = Path(sys.executable).with_name("dvc")
    if exe.exists():
        return str(exe)
    found = shutil.which("dvc")
    if found is None:
        pytest.skip("dvc executable not found")
    return found


def _configured_template() -> str:
    return ConfigObj(str(REPO_ROOT / ".dvc" / "config"))["plots"]["html_template"]


def test_repo_config_points_at_committed_template():
    assert (REPO_ROOT / ".dvc" / _configured_template()).resolve() == TEMPLATE.resolve()


def test_template_inlines_pinned_builds():
    assert _builder().verify(TEMPLATE.read_bytes().decode("utf-8")) == []


def test_plots_show_renders_offline(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git not found")
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_SITE_CACHE_DIR": str(tmp_path / "site")}

    def run(*args: str) -> str:
        proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
        return proc.stdout

    dvc = _dvc()
    run("git", "init", "-q")
    run(dvc, "init", "-q")
    rel = _configured_template()
    (repo / ".dvc" / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TEMPLATE, repo / ".dvc" / rel)
    run(dvc, "config", "plots.html_template", rel)
    (repo / ".dvc" / "plots" / "series.json").write_text(json.dumps(SERIES_TEMPLATE, indent=2))
    (repo / "reports").mkdir()
    (repo / "reports" / "frontier.json").write_text(json.dumps(RECORDS, indent=2))
    (repo / "dvc.yaml").write_text(DVC_YAML)

    run(dvc, "plots", "show", "--out", "plots_out")
    html = (repo / "plots_out" / "index.html").read_text(encoding="utf-8")

    # Nothing is loaded by URL; the pinned libraries are inlined ahead of the plots that call vegaEmbed.
    assert "<script src" not in html.lower()
    assert "cdn.jsdelivr.net" not in html
    first_plot = html.index("vegaEmbed('#")
    for pin in _builder().PINS:
        marker = f"/* {pin.name}@{pin.version} */"
        assert marker in html
        assert html.index(marker) < first_plot

    specs = [json.loads(s) for s in re.findall(r"var spec = (.*);\n", html)]
    assert len(specs) == 3
    by_encoding = {}
    for spec in specs:
        assert spec["$schema"] == "https://vega.github.io/schema/vega-lite/v5.json"
        key = (spec["encoding"]["y"]["field"], spec["encoding"]["color"]["field"])
        by_encoding[key] = spec

    def rows(spec, *fields):
        return sorted(tuple(v[f] for f in fields) for v in spec["data"]["values"])

    expected = sorted((r["point"], r["flops_ratio"], r["accuracy"]) for r in RECORDS)

    # (a) built-in scatter of one file: series by revision only; the record fields ride along in the data.
    plain = by_encoding[("accuracy", "rev")]
    assert rows(plain, "point", "flops_ratio", "accuracy") == expected

    # (b) several y-fields of one file: DVC stacks them into dvc_inferred_y_value, `field` tells them apart.
    multi = by_encoding[("dvc_inferred_y_value", "rev")]
    assert multi["encoding"]["shape"]["field"] == "field"
    assert sorted({v["field"] for v in multi["data"]["values"]}) == ["accuracy", "f1"]
    assert len(multi["data"]["values"]) == 2 * len(RECORDS)

    # A series per record field needs a user template that encodes that field.
    series = by_encoding[("accuracy", "point")]
    assert rows(series, "point", "flops_ratio", "accuracy") == expected
