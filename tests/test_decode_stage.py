"""The decode stage on a tiny model: config checks, the run file, its artifacts, MLflow, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from emad.calibration.profile import variant_path
from emad.config import ConfigError, validate_section
from emad.evaluation import runfile
from emad.evaluation.config import DecodeConfig
from emad.report.heatmap import heatmap_html
from tests.tiny import save_tiny_pretrained, save_tiny_profiles

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Entropy falls with depth for easy tokens. The quick brown fox jumps over the lazy dog. " * 12
DECODE = {
    "domains": {"toy": ["perplexity", "fidelity"]},
    "tasks": {"perplexity": {"tokens": 160, "window": 48, "prefix": 16},  # 5 windows: 2 blocks to resample
              "fidelity": {"prompts": 16, "prompt_tokens": 12, "new_tokens": 6}},
    "baselines": {"full": {"method": "full"}, "fixed-2": {"method": "fixed", "depth": 2}},
    "points": {"emad-m0": {"method": "emad", "margin": 0.0, "strata": "none"}},
    "default_point": "emad-m0",
    "ablations": {"backfill": {"policy": "backfill"}, "strata-position": {"strata": "position"},
                  "strata-confidence": {"strata": "confidence"}},
    "ablation_domains": ["toy"],
    "related": {"ead-k2": {"method": "ead", "small_layers": 2, "tau": 3.0, "window": 2, "d_min": 2},
                   "spec-e2": {"method": "speculative", "exit_layer": 2, "draft_policy": "adaedl"},
                   "gap-prune": {"method": "softmax", "threshold": 0.5, "probe_every": 1, "estimator": "prune",
                                 "prune_k": 32}},
    "related_domains": ["toy"],
    "heatmap_texts": 2, "device": "cpu", "dtype": "float32",
}


def make_workspace(root: Path, tokenizer, decode: dict) -> Path:
    """A tiny model, one domain (``toy``), a profile with a position axis and ``decode`` as params.yaml under
    ``root``."""
    save_tiny_pretrained(root / "model", tokenizer)
    corpus = root / "corpora" / "toy"
    corpus.mkdir(parents=True)
    docs = [{"id": str(i), "text": TEXT[i * 5:], "n_tokens": 0} for i in range(3)]
    (corpus / "eval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (corpus / "manifest.json").write_text(json.dumps({"manifest_sha256": "toy"}))
    save_tiny_profiles(root / "model", [TEXT] * 2, root / "profile.json", position_edges=[8])
    (root / "params.yaml").write_text(yaml.safe_dump({"decode": decode}))
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2):
    return make_workspace(tmp_path_factory.mktemp("decode"), smollm2.tokenizer, DECODE)


def _decode(root: Path, kind: str, point: str, monkeypatch, **extra) -> int:
    import pipeline.decode as stage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    args = ["--kind", kind, *(a for k in extra.pop("kinds", []) for a in ("--kind", k)), "--point", point,
            "--model", "tiny", "--model-dir", str(root / "model"),
            "--domain", extra.pop("domain", "toy"), "--corpora", str(root / "corpora"),
            "--out", str(root / extra.pop("runs", "runs") / f"{kind}-{point}"),
            "--artifacts", str(root / "art"),
            "--params", str(extra.pop("params", root / "params.yaml"))]
    if kind not in ("baseline", "related"):
        args += ["--calibration", "toy", "--profile", str(extra.pop("profile", root / "profile.json"))]
    return stage.main(args)


def _record(root: Path, name: str) -> dict:
    """The run file of stage call ``name`` (``<kind>-<point>``) on its one domain."""
    (path,) = (root / "runs" / name).glob("*.json")
    return runfile.load(path)


def test_baseline_run_file_artifacts_and_mlflow(workspace, monkeypatch):
    assert _decode(workspace, "baseline", "full", monkeypatch) == 0
    record = _record(workspace, "baseline-full")
    assert record["run_id"] == "tiny--full--toy" and record["family"] == "full"
    assert record["cost"]["flops_ratio"] == pytest.approx(1.0)
    assert record["tasks"]["fidelity"]["exact_match"] == 1.0
    assert set(record["quality"]) >= {"perplexity", "fidelity.token_agreement"}
    assert set(record["intervals"]) == set(record["quality"])  # every quality metric: 95% interval and n
    ppl = record["intervals"]["perplexity"]
    assert ppl["n"] == len(record["tasks"]["perplexity"]["samples"]["perplexity"]) >= 2
    assert ppl["lo"] <= record["quality"]["perplexity"] <= ppl["hi"]
    assert record["depth_histogram"] == {"4": record["cost"]["tokens"]}
    assert record["identity"] == {"proved": True, "why": "never exits: every token ran all layers", "final_from": 4}
    split = record["split"]  # recorded: the seed and each task's two disjoint halves
    assert split["seed"] == 0 and not set(split["fidelity"]["selection"]) & set(split["fidelity"]["confirmation"])
    assert (workspace / "art" / "full" / "toy" / "depth.png").stat().st_size > 1000
    html = (workspace / "art" / "full" / "toy" / "heatmap.html").read_text()
    assert html.count('title="layer 4"') >= 2
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["emad"], filter_string="tags.run_id = 'tiny--full--toy'")
    assert record["mlflow_run_id"] in set(runs["run_id"])
    assert runs.iloc[0]["metrics.flops_ratio"] == pytest.approx(1.0)
    assert runs.iloc[0]["metrics.quality.perplexity.perplexity.lo"] == pytest.approx(ppl["lo"])
    assert runs.iloc[0]["metrics.quality.perplexity.perplexity.n"] == ppl["n"]
    assert runs.iloc[0]["tags.mlflow.runName"] == "decode tiny full toy"
    where = record["provenance"]  # where the unit was computed, in the run file and as MLflow tags
    assert (where["device"], where["dtype"]) == ("cpu", "float32") and where["torch_threads"] >= 1
    assert where["host"] and where["cpu"] and where["torch"] and where["code_revision"]
    assert runs.iloc[0]["tags.provenance.dtype"] == "float32"
    assert {"params.family", "params.knob", "params.calibration", "params.domain"} <= set(runs.columns)
    assert not [c for c in runs.columns if c.startswith("params.") and runs.iloc[0][c] == "None"]


def test_point_and_ablation_runs_carry_profile_factors(workspace, monkeypatch):
    assert _decode(workspace, "point", "emad-m0", monkeypatch) == 0
    assert _decode(workspace, "ablation", "backfill", monkeypatch) == 0
    point = _record(workspace, "point-emad-m0")
    ablation = _record(workspace, "ablation-backfill")
    assert point["run_id"] == "tiny--emad-m0--cal-toy--toy" and point["calibration"] == "toy"
    assert point["factors"] == {"margin": 0.0, "policy": "monotone", "estimator": "exact", "probe_stride": 1,
                                "strata": "none"}
    assert {k for k, v in ablation["factors"].items() if point["factors"][k] != v} == {"policy"}
    assert set(point["oracle"]) == {"1", "2", "3", "4"} and len(point["profile_fingerprint"]) == 16
    assert point["options"]["strata"] == "none"


def test_baselines_and_points_of_every_calibration_share_one_pass(workspace, monkeypatch):
    """The decode stage: baselines and points together, each point with each calibration source's profile, the
    teacher-forced tasks of all of them scored by one call per domain; each run as the point's own call writes it."""
    import shutil

    import emad.evaluation.decoder as decoder
    import pipeline.decode as stage

    for cal in ("a", "b"):
        shutil.copytree(variant_path(workspace / "profile.json", "none").parent, workspace / "cals" / cal / "strata",
                        dirs_exist_ok=True)
        shutil.copy(workspace / "profile.json", workspace / "cals" / cal / "profile.json")
    scored = []
    real = decoder.score_all
    monkeypatch.setattr(decoder, "score_all", lambda stack, tok, methods, *rest: scored.append(sorted(methods))
                        or real(stack, tok, methods, *rest))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    common = ["--model", "tiny", "--model-dir", str(workspace / "model"), "--corpora", str(workspace / "corpora"),
              "--artifacts", str(workspace / "art-both"), "--params", str(workspace / "params.yaml")]
    assert stage.main(["--kind", "baseline", "--kind", "point", "--point", "full", "--point", "emad-m0",
                       "--calibration", "a", "--calibration", "b",
                       "--profile", str(workspace / "cals" / "{calibration}" / "profile.json"),
                       "--out", str(workspace / "runs" / "both"), *common]) == 0
    assert scored == [["emad-m0--cal-a", "emad-m0--cal-b", "full"]]
    runs = {p.stem: runfile.load(p) for p in (workspace / "runs" / "both").glob("*.json")}
    assert sorted(runs) == ["tiny--emad-m0--cal-a--toy", "tiny--emad-m0--cal-b--toy", "tiny--full--toy"]
    assert (workspace / "art-both" / "emad-m0--cal-b" / "toy" / "heatmap.html").is_file()
    assert stage.main(["--kind", "point", "--point", "emad-m0", "--calibration", "a",
                       "--profile", str(workspace / "cals" / "a" / "profile.json"),
                       "--out", str(workspace / "runs" / "alone"), *common]) == 0
    alone = runfile.load(workspace / "runs" / "alone" / "tiny--emad-m0--cal-a--toy.json")
    both = runs["tiny--emad-m0--cal-a--toy"]
    assert both["tasks"]["perplexity"]["perplexity"] == alone["tasks"]["perplexity"]["perplexity"]
    assert both["cost"]["flops_ratio"] == alone["cost"]["flops_ratio"]
    assert both["depth_histogram"] == alone["depth_histogram"]


def test_kinds_with_other_domains_or_tasks_are_refused_together(workspace, monkeypatch, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"decode": {**DECODE, "related_tasks": ["perplexity"]}}))
    with pytest.raises(ValueError, match="--kind baseline and --kind related run different domains or tasks"):
        _decode(workspace, "baseline", "full", monkeypatch, params=params, kinds=["related"], runs="mixed")
    assert not (workspace / "mixed").exists()


def test_a_plan_without_ablations_or_related_methods_writes_their_stages_empty_outputs(workspace, monkeypatch,
                                                                                      tmp_path):
    """params-powered.yaml runs no ablation and no related method: those stages end at once, their outputs (what
    DVC tracks) empty folders."""
    import pipeline.decode as stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"decode": {**DECODE, "ablations": {}, "ablation_domains": [], "related": {},
                                                 "related_domains": []}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for kind in ("ablation", "related"):
        out, art = tmp_path / f"runs-{kind}", tmp_path / f"art-{kind}"
        calibration = ["--calibration", "toy", "--profile", str(workspace / "profile.json")] if kind == "ablation" else []
        assert stage.main(["--kind", kind, "--model", "tiny", "--model-dir", str(workspace / "model"),
                           "--corpora", str(workspace / "corpora"), "--out", str(out), "--artifacts", str(art),
                           "--params", str(params), *calibration]) == 0
        assert out.is_dir() and not any(out.iterdir()) and art.is_dir() and not any(art.iterdir())


def test_related_runs_report_their_statistics(workspace, monkeypatch):
    assert _decode(workspace, "related", "ead-k2", monkeypatch) == 0
    assert _decode(workspace, "related", "spec-e2", monkeypatch) == 0
    ead = _record(workspace, "related-ead-k2")
    spec = _record(workspace, "related-spec-e2")
    assert ead["run_id"] == "tiny--ead-k2--toy" and ead["family"] == "ead" and ead["calibration"] is None
    assert ead["method"]["pair"] == "self" and ead["options"]["small_layers"] == 2
    assert 0 <= ead["cost"]["large_token_share"] <= 1 and set(ead["depth_histogram"]) <= {"2", "4"}
    assert ead["cost"]["ead_tokens"] == ead["cost"]["large_tokens"] + ead["cost"]["small_tokens"]
    assert spec["tasks"]["fidelity"]["exact_match"] == 1.0  # lossless
    if not list((workspace / "runs" / "baseline-full").glob("*.json")):  # this test alone: make the full run here
        assert _decode(workspace, "baseline", "full", monkeypatch) == 0
    assert spec["tasks"]["perplexity"]["perplexity"] == pytest.approx(
        _record(workspace, "baseline-full")["tasks"]["perplexity"]["perplexity"], rel=1e-5)
    assert 0 <= spec["cost"]["acceptance_rate"] <= 1 and spec["cost"]["target_passes_per_token"] <= 1
    assert spec["cost"]["flops_ratio"] > 0
    # a strategy trades FLOPs for fewer sequential passes: timed over prompts whatever its FLOPs ratio
    assert spec["cost"]["speed_timing"] == "pairs" and len(spec["cost"]["speed_pairs"]) >= 8
    assert not spec["identity"]["proved"] and "strategy" in spec["identity"]["why"]
    assert _decode(workspace, "related", "gap-prune", monkeypatch) == 0
    gap = _record(workspace, "related-gap-prune")
    assert gap["family"] == "softmax:prune" and gap["options"]["prune_k"] == 32 and gap["method"]["estimator"] == "prune"


def test_strata_ablation_uses_the_variant_and_refuses_a_missing_one(workspace, monkeypatch):
    assert _decode(workspace, "ablation", "strata-position", monkeypatch) == 0
    run = _record(workspace, "ablation-strata-position")
    assert run["factors"]["strata"] == "position" and run["method"]["strata"] == "position"
    with pytest.raises(FileNotFoundError, match=r"strata='confidence'.*variants there: none, position.*"
                                                r"calibrate.strata"):
        _decode(workspace, "ablation", "strata-confidence", monkeypatch, runs="failed-strata")
    assert not (workspace / "failed-strata").exists()


def test_missing_profile_fails_before_work_and_writes_nothing(workspace, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        _decode(workspace, "point", "emad-m0", monkeypatch, profile=workspace / "nowhere.json", runs="failed")
    assert not (workspace / "failed").exists()


def test_unknown_domain_or_point_is_named(workspace, monkeypatch):
    with pytest.raises(ValueError, match="'nope'.*decode.domains"):
        _decode(workspace, "baseline", "full", monkeypatch, domain="nope")
    with pytest.raises(ValueError, match="--point 'fixed-9': not a baseline point or sweep.*full"):
        _decode(workspace, "baseline", "fixed-9", monkeypatch)


@pytest.mark.parametrize("change, culprit", [
    ({"domains": {"toy": ["poetry"]}}, "unknown or no tasks"),
    ({"tasks": {"perplexity": {"tokens": 0}}}, "decode.tasks.perplexity.tokens"),
    ({"baselines": {"e": {"method": "emad", "margin": 1}}}, "baselines.e: method 'emad' belongs under points"),
    ({"points": {"m0.5": {"method": "emad", "margin": 0.5}}}, "no dots"),
    ({"default_point": "missing"}, "default_point 'missing'"),
    ({"ablations": {"x": {"policy": "teleport"}}}, "decode.ablations.x.policy: .*unknown policy 'teleport'"),
    ({"ablation_domains": ["elsewhere"]}, "ablation_domains"),
    ({"related_domains": ["elsewhere"]}, "related_domains"),
    ({"ablation_tasks": ["cloze"]}, r"ablation_tasks \['cloze'\] are not tasks of ablation domain 'toy'"),
    ({"related_tasks": ["gsm8k"]}, r"related_tasks \['gsm8k'\] are not tasks of related domain 'toy'"),
    ({"related": {"s": {"method": "emad", "margin": 1.0}}}, "related.s: method 'emad' needs a profile"),
    ({"baselines": {"s": {"method": "ead", "tau": 1.0, "small_layers": 2}}}, "belongs under related"),
    ({"related": {"full": {"method": "ead", "tau": 1.0, "small_layers": 2}}}, "'full' is in baselines and"),
    ({"related": {"s": {"method": "ead", "tau": "warm"}}}, "decode.related.s.tau"),
    ({"baselines": {"f": {"method": "fixed", "dept": 3}}}, "decode.baselines.f.dept"),
    # sweeps: a list for the knob stands for one point per value
    ({"points": {"s": {"method": "emad", "margin": []}}}, r"decode\.points\.s\.margin: an empty list"),
    ({"points": {"s": {"method": "emad", "margin": [1, "high"]}}}, r"decode\.points\.s\.margin: 'high' is not a number"),
    ({"points": {"s": {"method": "emad", "margin": [1, 2, 1.0]}}}, r"decode\.points\.s\.margin: the value 1.0 is listed twice"),
    ({"baselines": {"s": {"method": "confidence", "threshold": 1, "min_exit_layer": [1, 2]}}},
     r"decode\.baselines\.s\.min_exit_layer: a list or range sweeps the method's knob only \(method 'confidence': threshold\)"),
    ({"baselines": {"f": {"method": "full", "depth": [1, 2]}}}, r"decode\.baselines\.f\.depth: .*'full': no knob"),
    ({"baselines": {"fixed": {"method": "fixed", "depth": [2, 3]}, "fixed_2": {"method": "fixed", "depth": 1}}},
     r"decode\.baselines\.fixed\.depth: the value 2 makes point 'fixed_2', a name already taken"),
    ({"related": {"s_1": {"method": "softmax", "threshold": 0.5}},
      "points": {"s": {"method": "emad", "margin": [1, 2]}}}, r"point 's_1' \(from a sweep\) is also in"),
    ({"curves": {}}, "decode.curves is filled from the points' sweeps"),
])
def test_bad_decode_params_name_the_culprit(change, culprit):
    with pytest.raises(ConfigError, match=culprit):
        validate_section("decode", {**DECODE, **change}, DecodeConfig)


def test_a_sweep_expands_to_one_point_per_value_that_knows_its_curve():
    cfg = validate_section("decode", {**DECODE, "points": {"emad": {"method": "emad", "margin": [0, 0.5, 2]}},
                                      "default_point": "emad_0.5",
                                      "related": {"ead": {"method": "ead", "small_layers": 2, "tau": [1, 3]}}},
                           DecodeConfig)
    assert cfg.names_of("point") == ["emad_0", "emad_0.5", "emad_2"]
    assert cfg.point("point", "emad_0.5").margin == 0.5 and cfg.point("related", "ead_3").tau == 3.0
    assert cfg.curve_of("point", "emad_2").model_dump() == {"curve": "emad", "knob": "margin", "value": 2.0,
                                                            "screened": False}
    assert cfg.curve_of("baseline", "fixed-2").model_dump() == {"curve": "fixed-2", "knob": "depth", "value": 2.0,
                                                                "screened": False}
    assert cfg.curve_of("baseline", "full").model_dump() == {"curve": "full", "knob": None, "value": None,
                                                             "screened": False}
    assert cfg.select("point", ["emad"]) == cfg.names_of("point") and cfg.select("point", ["emad_2"]) == ["emad_2"]
    assert cfg.is_swept("emad_0") and not cfg.is_swept("full")


def test_a_swept_stage_writes_one_run_per_value_each_timed_against_full_depth_here(workspace, monkeypatch):
    import mlflow

    params = workspace / "params-sweep.yaml"
    sweep = {**DECODE, "domains": {"toy": ["perplexity", "agreement", "fidelity"]},
             "tasks": {**DECODE["tasks"], "agreement": {"prompts": 16, "prompt_tokens": 12, "new_tokens": 6}},
             "baselines": {"conf": {"method": "confidence", "threshold": [0.5, 8, 1000], "probe_every": 1}},
             "swept_prompts": 1, "speed_repeats": 2, "speed_tokens": 4}
    params.write_text(yaml.safe_dump({"decode": sweep}))
    assert _decode(workspace, "baseline", "conf", monkeypatch, runs="sweep-runs", params=params) == 0
    records = sorted((runfile.load(p) for p in (workspace / "sweep-runs" / "baseline-conf").glob("*.json")),
                     key=lambda r: r["value"])
    assert [(r["point"], r["curve"], r["knob"], r["value"]) for r in records] == [
        ("conf_0.5", "conf", "threshold", 0.5), ("conf_8", "conf", "threshold", 8.0),
        ("conf_1000", "conf", "threshold", 1000.0)]
    timings = set()
    for r in records:
        cost = r["cost"]
        timings.add(cost["speed_timing"].split(":")[0])
        if cost["speed_timing"].startswith("none: violates"):  # ruled out: no free-running task, no timing
            assert cost["speedup"] is None and r["free_prompts"] == 0 and "fidelity" not in r["tasks"]
            assert r["not_run"]["fidelity"].startswith("the teacher-forced screen rules the point out (violates")
            continue
        assert cost["reference_tokens_per_s"] > 0 and cost["speed_tokens_per_s"] > 0
        assert cost["speedup"] > 0 and cost["load_avg"] is not None
        if cost["speed_timing"] == "pairs":  # the screen keeps it: every prompt, timed on 8 distinct prompts (of
            # the confirmation half)
            assert cost["speed_unit"] == "prompt" and len(cost["speed_pairs"]) == 8 and r["free_prompts"] is None
            assert len(r["tasks"]["fidelity"]["samples"]["exact_match"]) == 16
        elif cost["speed_timing"].startswith("cheap: FLOPs ratio"):  # computes as much as full depth: every prompt,
            assert cost["speed_repeats"] == 2 and r["free_prompts"] is None  # the cheap measure
            assert len(r["tasks"]["fidelity"]["samples"]["exact_match"]) == 16
        else:  # never exits: the cheap measure on the first prompt
            assert cost["speed_timing"] == "cheap: never exits" and cost["speed_repeats"] == 2
            assert r["free_prompts"] == 1 and len(r["tasks"]["fidelity"]["samples"]["exact_match"]) == 1
        assert 0 <= r["quality"]["agreement.token_agreement"] <= 1 and r["tasks"]["perplexity"]["tokens"] > 0
    # the higher the entropy threshold, the earlier tokens exit: cost falls along the curve
    flops = [r["cost"]["flops_ratio"] for r in records]
    assert flops == sorted(flops, reverse=True) and flops[0] > flops[-1]
    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    names = {r.info.run_name for r in mlflow.search_runs(experiment_names=["emad"], output_format="list")}
    assert {f"decode tiny {r['point']} toy" for r in records} <= names


def test_a_point_computing_as_much_as_full_depth_is_judged_on_every_prompt_but_not_timed_for_c2(workspace,
                                                                                                  monkeypatch):
    params = workspace / "params-flops.yaml"
    point = {**DECODE, "domains": {"toy": ["perplexity", "fidelity"]},
             "baselines": {"conf": {"method": "confidence", "threshold": [1000], "probe_every": 1}},
             "swept_prompts": 1, "speed_repeats": 1, "speed_tokens": 4}
    for below, timing in ((None, "pairs"), (0.5, "cheap: FLOPs ratio")):  # its teacher-forced FLOPs ratio is ~0.98
        params.write_text(yaml.safe_dump({"decode": {**point, "speed_flops_below": below}}))
        runs = f"flops-runs-{below}"
        assert _decode(workspace, "baseline", "conf", monkeypatch, runs=runs, params=params) == 0
        (record,) = [runfile.load(p) for p in (workspace / runs / "baseline-conf").glob("*.json")]
        cost = record["cost"]
        assert 0.5 < cost["flops_ratio"] < 1 and cost["speed_timing"].startswith(timing)
        assert record["free_prompts"] is None and len(record["tasks"]["fidelity"]["samples"]["exact_match"]) == 16
        assert (cost["speed_unit"] == "prompt") == (below is None)


def test_ablation_and_related_tasks_narrow_their_kind_only():
    cfg = validate_section("decode", {**DECODE, "ablation_tasks": ["fidelity"], "related_tasks": ["perplexity"]},
                           DecodeConfig)
    assert cfg.tasks_of("ablation", "toy") == ["fidelity"] and cfg.tasks_of("related", "toy") == ["perplexity"]
    assert cfg.tasks_of("point", "toy") == cfg.tasks_of("baseline", "toy") == ["perplexity", "fidelity"]
    assert validate_section("decode", DECODE, DecodeConfig).tasks_of("ablation", "toy") == ["perplexity", "fidelity"]


def test_heatmap_escapes_tokens_and_shades_by_depth():
    page = heatmap_html([[("<b>", 1), (" ok", 30)]], 30, "run & co")
    assert "&lt;b&gt;" in page and "<b>" not in page.split("<body>")[1]
    assert 'title="layer 1"' in page and 'title="layer 30"' in page and "run &amp; co" in page


def test_runs_do_not_depend_on_the_working_directory(workspace, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert _decode(workspace, "baseline", "fixed-2", monkeypatch) == 0
    assert _record(workspace, "baseline-fixed-2")["cost"]["mean_depth"] < 4
    assert os.listdir(tmp_path) == []


RISK = {"domain": "toy", "prompts": 6, "fresh_prompts": 4, "prompt_tokens": 8, "new_tokens": 6, "delta": 0.3,
        "epsilon": 0.3, "device": "cpu", "dtype": "float32",
        "searches": {"margin": {"point": {"method": "emad"}, "knob": "margin", "values": [0.0, 100.0, 1.0]},
                     "gap": {"point": {"method": "softmax", "probe_every": 1}, "knob": "threshold",
                             "values": [0.5, 2.0]}}}


def _risk(root: Path, search: str, monkeypatch, risk: dict | None = None) -> Path:
    import pipeline.risk as stage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    params = root / "risk-params.yaml"
    params.write_text(yaml.safe_dump({"risk": risk or RISK}))
    out = root / "risk" / search
    assert stage.main(["--search", search, "--model", "tiny", "--model-dir", str(root / "model"),
                       "--corpus", str(root / "corpora" / "toy"), "--calibration", "toy", "--profile",
                       str(root / "profile.json"), "--out", str(out), "--params", str(params)]) == 0
    return out / f"tiny--{search}--cal-toy.json"


def test_risk_stage_certifies_from_the_conservative_end_and_checks_on_fresh_prompts(workspace, monkeypatch):
    result = json.loads(_risk(workspace, "margin", monkeypatch).read_text())
    assert result["format"] == "emad-risk" and result["values"] == [100.0, 1.0, 0.0]  # high margin exits least
    assert result["risks"][0] == 0.0 and result["p_values"][0] <= 0.3  # margin 100 never exits: no loss
    assert result["chosen"] in result["values"] and result["n"] == 6 and result["fresh_n"] == 4
    assert result["fresh_holds"] == (result["fresh_risk"] <= 0.3) and result["fresh_flops_ratio"] > 0
    assert result["guarantee"].startswith(f"margin = {result['chosen']:g}")
    gap = json.loads(_risk(workspace, "gap", monkeypatch).read_text())
    assert gap["values"] == [2.0, 0.5] and gap["risks"][0] == 0.0
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["emad"], filter_string="tags.dvc_stage = 'risk'")
    assert {result["mlflow_run_id"], gap["mlflow_run_id"]} <= set(runs["run_id"])


@pytest.mark.parametrize("change, culprit", [
    ({"prompts": 3}, "need at least 4 held-out prompts, got 3"),
    ({"delta": 1.0}, r"risk\.delta"),
    ({"epsilon": 0.0}, r"risk\.epsilon"),
    ({"loss": "bleu"}, "loss must be one of agreement, exact"),
    ({"searches": {"s": {"point": {"method": "emad"}, "knob": "threshold", "values": [1.0]}}},
     "knob 'threshold' is not a scalar knob of method 'emad'; valid: margin"),
    ({"searches": {"s": {"point": {"method": "emad"}, "knob": "margin", "values": []}}}, r"risk\.searches\.s\.values"),
])
def test_bad_risk_params_name_the_culprit(change, culprit):
    from emad.evaluation.risk_config import RiskConfig

    with pytest.raises(ConfigError, match=culprit):
        validate_section("risk", {**RISK, **change}, RiskConfig)


@pytest.mark.parametrize("domains", [["toy"], ["toy", "other"]])
def test_c2_candidates_share_blocks_and_a_family_that_passed_on_the_only_domain_stops(
        domains, monkeypatch):
    """On the only domain each round times the next candidate of every family left (rising FLOPs) together, and a
    family whose timed point passes C2 has decided it: its dearer candidates get the cheap measure — a family alone
    the same as beside others, so that its timed candidates do not depend on the families it runs with. With
    several domains nothing is decided on one: every candidate is timed in one block."""
    from types import SimpleNamespace

    from emad.evaluation.checks import Thresholds
    from emad.evaluation.decoder import Decoder

    def done(label, family, flops, why=None):
        job = SimpleNamespace(label=label, point=SimpleNamespace(method="full" if label == "full" else "conf",
                                                                 family=family), method=None)
        return job, why, None, SimpleNamespace(cost=lambda: {"flops_ratio": flops}, tasks={})

    decoder = object.__new__(Decoder)
    decoder.plan = SimpleNamespace(domains=domains, thresholds=Thresholds(),
                                   cfg=SimpleNamespace(speed_candidates=None, speed_flops_below=1.0, split_seed=0))
    cheap, blocks = [], []
    monkeypatch.setattr(decoder, "_speed", lambda job, prepared, result, limit, why: cheap.append(
        (job.label, why)) or {"speed_timing": f"cheap: {why}"})
    monkeypatch.setattr(decoder, "_time_block", lambda prepared, block: blocks.append(
        [job.label for job, _, _ in block]) or [{"speed_timing": "pairs"} for _ in block])
    monkeypatch.setattr(decoder, "_passes_c2", lambda domain, job, result, full, speed, floor: result.cost()[
        "flops_ratio"] < 0.8)  # every point below 0.8 passes C2 on this domain
    speeds = decoder._speeds("toy", [], [done("full", "full", 1.0, "full depth"), done("f_a", "f", 0.9),
                                         done("f_b", "f", 0.7), done("f_c", "f", 0.75), done("g_a", "g", 0.85)])
    stopped = "C2 decided for f by f_b"
    expected = {"f_b": "pairs", "g_a": "pairs", "full": "cheap: full depth"}
    if len(domains) == 1:  # f_b decided C2 for family f: its dearer points get the cheap measure
        assert blocks == [["f_b", "g_a"]]
        full = done("full", "full", 1.0, "full depth")
        speeds_left = decoder._speeds("toy", [], [full, done("f_a", "f", 0.9), done("f_c", "f", 0.85),
                                                  done("g_a", "g", 0.82), done("g_b", "g", 0.95)])
        assert blocks[1:] == [["f_c", "g_a"], ["f_a", "g_b"]] and len(speeds_left) == 5  # no family passes
        blocks.clear()
        decoder._speeds("toy", [], [full, done("f_a", "f", 0.9), done("f_c", "f", 0.85), done("g_a", "g", 0.7)])
        assert blocks == [["f_c", "g_a"], ["f_a"]]  # g decided: f's last candidate alone
        blocks.clear()
        decoder._speeds("toy", [], [full, done("f_a", "f", 0.9), done("f_c", "f", 0.85), done("f_d", "f", 0.95),
                                    done("g_a", "g", 0.7)])
        assert blocks == [["f_c", "g_a"], ["f_a"], ["f_d"]]  # one family left: still one candidate a round
        blocks.clear()
        alone = decoder._speeds("toy", [], [full, done("f_a", "f", 0.75), done("f_d", "f", 0.7)])
        assert blocks == [["f_d"]] and alone["f_a"] == {"speed_timing": "cheap: C2 decided for f by f_d"}
        expected |= {"f_c": f"cheap: {stopped}", "f_a": f"cheap: {stopped}"}
    else:  # a point's C2 interval pools every domain's prompts: nothing is decided on one of them
        assert blocks == [["f_b", "f_c", "f_a", "g_a"]]  # every candidate in one block
        expected |= {"f_c": "pairs", "f_a": "pairs"}
    assert {label: speed["speed_timing"] for label, speed in speeds.items()} == expected


def test_a_family_times_at_most_speed_candidates_on_a_domain_its_cheapest(monkeypatch):
    """decode.speed_candidates: of a family's C2 candidates on a domain, the cheapest (teacher-forced FLOPs) that many
    are timed over prompts; the dearer ones get the cheap measure, saying why."""
    from types import SimpleNamespace

    from emad.evaluation.checks import Thresholds
    from emad.evaluation.decoder import Decoder

    def done(label, family, flops):
        job = SimpleNamespace(label=label, point=SimpleNamespace(method="conf", family=family), method=None)
        return job, None, None, SimpleNamespace(cost=lambda: {"flops_ratio": flops}, tasks={})

    decoder = object.__new__(Decoder)
    decoder.plan = SimpleNamespace(domains=["toy", "other"], thresholds=Thresholds(),
                                   cfg=SimpleNamespace(speed_candidates=2, speed_flops_below=1.0, split_seed=0))
    blocks = []
    monkeypatch.setattr(decoder, "_speed", lambda job, prepared, result, limit, why: {"speed_timing": f"cheap: {why}"})
    monkeypatch.setattr(decoder, "_time_block", lambda prepared, block: blocks.append(
        [job.label for job, _, _ in block]) or [{"speed_timing": "pairs"} for _ in block])
    speeds = decoder._speeds("toy", [], [done("f_a", "f", 0.9), done("f_b", "f", 0.7), done("f_c", "f", 0.8),
                                         done("g_a", "g", 0.85)])
    assert blocks == [["f_b", "f_c", "g_a"]]
    assert speeds["f_a"] == {"speed_timing": "cheap: not among f's 2 cheapest C2 candidates on toy "
                                             "(decode.speed_candidates)"}
    decoder.plan.cfg.speed_candidates, blocks[:] = 1, []  # params.yaml's default: one candidate per family
    speeds = decoder._speeds("toy", [], [done("f_a", "f", 0.9), done("f_b", "f", 0.7), done("f_c", "f", 0.8),
                                         done("g_a", "g", 0.85)])
    assert blocks == [["f_b", "g_a"]]
    assert speeds["f_c"] == speeds["f_a"] == {"speed_timing": "cheap: not f's cheapest C2 candidate on toy "
                                                              "(decode.speed_candidates)"}


def test_the_early_stop_reads_the_identity_proof_as_the_verdict_does():
    """C2's early stop judges a point's checks as the verdict will: with the proof the run file records, equal
    perplexity windows are identical by construction (and the gate is met); without it they bound nothing."""
    from emad.evaluation.checks import Thresholds, checks_against
    from emad.evaluation.judge import passes_c2
    from emad.evaluation.states import IDENTICAL
    from emad.evaluation.units import SELECTION, Units

    windows = [[20.0 + i, 10] for i in range(16)]
    tasks = {"perplexity": {"perplexity": 7.3, "samples": {"perplexity": windows}}}
    fast = [[130.0, 100.0]] * 8
    plain = checks_against("toy", tasks, tasks, Thresholds().tolerance, Units(SELECTION, 0))
    proved = checks_against("toy", tasks, tasks, Thresholds().tolerance, Units(SELECTION, 0),
                            identity={"proved": True, "why": "exits only where the state is final", "final_from": 4})
    assert [c.state for c in proved] == [IDENTICAL] and passes_c2(proved, fast, 1.1)
    assert [c.state for c in plain] == ["unresolved"] and not passes_c2(plain, fast, 1.1)


def test_a_written_out_point_the_screen_rules_out_decodes_nothing_free_running_and_says_why(workspace, monkeypatch):
    from types import SimpleNamespace

    from emad.evaluation.decoder import Decoder

    monkeypatch.setattr(Decoder, "_ruled_out", lambda self, domain, forced: [SimpleNamespace(metric="perplexity")])
    params = workspace / "params-ruled-out.yaml"
    params.write_text(yaml.safe_dump({"decode": {**DECODE, "baselines": {"fixed-1": {"method": "fixed", "depth": 1}}}}))
    assert _decode(workspace, "baseline", "fixed-1", monkeypatch, runs="ruled-out", params=params) == 0
    (path,) = (workspace / "ruled-out" / "baseline-fixed-1").glob("*.json")
    r = runfile.load(path)
    assert not r["screened"] and r["cost"]["speed_timing"] == ("none: violates perplexity (teacher forced, selection "
                                                               "split)")
    assert r["free_prompts"] == 0 and "fidelity" not in r["tasks"] and r["cost"]["speedup"] is None
    assert r["not_run"]["fidelity"] == "the teacher-forced screen rules the point out (violates perplexity (teacher " \
                                       "forced, selection split))"


def test_the_default_point_keeps_its_free_running_tasks_on_the_cells_the_ablations_read():
    from types import SimpleNamespace

    from emad.evaluation.decoder import Decoder

    decoder = object.__new__(Decoder)
    decoder.plan = SimpleNamespace(cfg=SimpleNamespace(default_point="emad-m0", ablation_domains=["toy"],
                                                       ablation_calibration="cal"))

    def job(kind="point", name="emad-m0", calibration="cal"):
        return SimpleNamespace(kind=kind, name=name, calibration=calibration)

    assert decoder._ablation_base(job(), "toy")
    assert not decoder._ablation_base(job(), "other")  # a domain the ablations do not run
    assert not decoder._ablation_base(job(calibration="other"), "toy")
    assert not decoder._ablation_base(job(name="emad-m1"), "toy")
    assert not decoder._ablation_base(job(kind="ablation"), "toy")


@pytest.mark.heavy
def test_the_decode_stage_on_the_engine_cuda_runs_writes_what_the_eager_engine_writes(workspace, monkeypatch):
    """``decode.engine: compiled`` as CUDA runs it (probes fused, segments and probes replayed as graphs:
    :mod:`tests.cuda_like`), with HF's static-cache ``generate`` timed beside our full depth as on CUDA: every kind's
    run files equal the eager engine's, timings (which reference was faster among them) and provenance aside."""
    from emad.evaluation import speed
    from tests.cuda_like import ReplayedOnCPU, patch_engine_as_on_cuda
    from tools.compare_runs import _clean

    monkeypatch.setattr(speed, "HF_STATIC_DEVICES", ("cuda", "cpu"))
    patch_engine_as_on_cuda(monkeypatch)
    calls = [("baseline", "full"), ("baseline", "fixed-2"), ("point", "emad-m0"), ("ablation", "backfill"),
             ("related", "ead-k2"), ("related", "spec-e2"), ("related", "gap-prune")]
    written, replays = {}, {}
    for engine in ("eager", "compiled"):
        params = workspace / f"params-{engine}.yaml"
        params.write_text(yaml.safe_dump({"decode": {**DECODE, "engine": engine}}))
        before = ReplayedOnCPU.replays
        for kind, point in calls:
            assert _decode(workspace, kind, point, monkeypatch, params=params, runs=f"runs-{engine}") == 0
        replays[engine] = ReplayedOnCPU.replays - before
        written[engine] = {p.relative_to(workspace / f"runs-{engine}"): runfile.load(p)
                           for p in (workspace / f"runs-{engine}").rglob("*.json")}
    assert replays["eager"] == 0 and replays["compiled"] > 0  # the compiled stage ran on replayed graphs
    assert len(written["eager"]) == len(calls) and set(written["eager"]) == set(written["compiled"])
    timed = [r["cost"]["speedup_by_reference"] for r in written["compiled"].values()
             if r["cost"].get("speedup_by_reference") is not None]
    assert timed and all(set(t) == {speed.FULL_DEPTH, speed.HF_STATIC} for t in timed)  # both references, as on CUDA
    for rel, eager in written["eager"].items():
        assert _differences(_clean(written["compiled"][rel]), _clean(eager)) == [], rel


def _differences(a, b, where: str = "", rel: float = 1e-5) -> list[str]:
    """Where ``a`` and ``b`` differ: floats by more than ``rel`` (the same sums in another order: attention over a
    static cache's whole buffer under a mask rounds apart from a growing cache's), everything else exactly."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}", rel)]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]", rel)]
    if isinstance(a, float) and isinstance(b, float):
        return [] if a == pytest.approx(b, rel=rel, nan_ok=True) else [f"{where}: {a} vs {b}"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def test_a_c2_candidate_is_chosen_on_the_judged_halfs_flops(monkeypatch):
    """A point below full depth's FLOPs over every unit but not on the confirmation half (the half the verdict reads
    its FLOPs on) is no C2 candidate: the cheap measure, saying why; one below on that half is timed."""
    from types import SimpleNamespace

    from emad.evaluation.checks import Thresholds
    from emad.evaluation.decoder import Decoder
    from emad.evaluation.units import CONFIRMATION, indices

    judged = set(indices(16, CONFIRMATION, 0, "fidelity"))

    def done(label, on_judged, elsewhere):  # FLOPs per unit against full depth's 1.0 per unit
        costs = [[on_judged if i in judged else elsewhere, 1.0] for i in range(16)]
        job = SimpleNamespace(label=label, point=SimpleNamespace(method="conf", family=label), method=None)
        result = SimpleNamespace(cost=lambda: {"flops_ratio": 0.9}, tasks={"fidelity": {"unit_flops": costs}})
        return job, None, None, result

    decoder = object.__new__(Decoder)
    decoder.plan = SimpleNamespace(domains=["toy", "other"], thresholds=Thresholds(),
                                   cfg=SimpleNamespace(speed_candidates=None, speed_flops_below=1.0, split_seed=0))
    cheap, blocks = [], []
    monkeypatch.setattr(decoder, "_speed", lambda job, prepared, result, limit, why: cheap.append(
        (job.label, str(why))) or {"speed_timing": f"cheap: {why}"})
    monkeypatch.setattr(decoder, "_time_block", lambda prepared, block: blocks.append(
        [job.label for job, _, _ in block]) or [{"speed_timing": "pairs"} for _ in block])
    decoder._speeds("toy", [], [done("dear", 1.01, 0.79), done("cheap", 0.8, 1.0)])
    assert blocks == [["cheap"]]
    assert cheap == [("dear", "FLOPs ratio 1.010 >= 1 (judged half)")]
