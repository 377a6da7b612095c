"""Screened sweeps: ranges and relative layers in params, the values a screen keeps, and the decode stage that
screens a dense grid teacher forced and runs only the kept values (on tiny models of different depths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from emad.config import ConfigError, validate_section
from emad.evaluation import runfile
from emad.evaluation.config import DecodeConfig
from emad.evaluation.screen import ScreenRow, keep
from tests.tiny import save_tiny_pretrained, save_tiny_profiles

TEXT = "Entropy falls with depth for easy tokens. The quick brown fox jumps over the lazy dog. " * 12
BASE = {"domains": {"toy": ["perplexity", "agreement", "fidelity"]},
        "tasks": {"perplexity": {"tokens": 96, "window": 48, "prefix": 16},
                  "agreement": {"prompts": 16, "prompt_tokens": 12, "new_tokens": 6},
                  "fidelity": {"prompts": 16, "prompt_tokens": 12, "new_tokens": 6}},
        "swept_prompts": 1, "speed_repeats": 1, "speed_tokens": 4, "heatmap_texts": 1,
        "device": "cpu", "dtype": "float32"}
SHAPED = {**BASE,  # the default params' shape: ranges, `all` and layers relative to L
          "baselines": {"full": {"method": "full"}, "fixed": {"method": "fixed", "depth": "all"},
                        "conf": {"method": "confidence", "threshold": {"from": 0.05, "to": 50, "points": 3,
                                                                       "spacing": "log", "grid": 12},
                                 "probe_every": 1, "min_exit_layer": "0.5L"}},
          "points": {"emad": {"method": "emad", "margin": {"from": 0, "to": "auto", "points": 3, "grid": 10,
                                                           "values": None}, "strata": "none"}}}


def _row(value: float, flops: float, exits: str, ruled_out: bool, curve: str = "c") -> ScreenRow:
    return ScreenRow(f"{curve}_{value:g}", curve, "confidence", "threshold", value, None, "toy", flops,
                     {"perplexity": 1.0}, ["perplexity"] if ruled_out else [], exits)


def test_keep_spreads_points_brackets_the_target_and_the_crossing_and_drops_equal_exits():
    # 12 values, FLOPs falling from 1.0 to 0.5; values 0 and 1 exit identically (never exit); lossless from 0.9 up
    rows = [_row(i, 1.0 - 0.05 * max(i - 1, 0), "same" if i < 2 else f"e{i}", 1.0 - 0.05 * max(i - 1, 0) < 0.9)
            for i in range(12)]
    kept = keep(rows, {"c": 4}, 0.85)
    assert "c_1" not in kept and "c_0" in kept  # equal exits count once: the first in grid order stands for them
    flops = {r.point: r.flops_ratio for r in rows}
    spread = {r.point for r in rows if "spread" in r.why}
    assert len(spread) == 4 and {flops[p] for p in spread} >= {1.0, 0.5}  # both ends, spread between
    assert {r.point for r in rows if "target" in r.why} == {"c_3", "c_4"}  # 0.9 and 0.85 beside the target 0.85
    assert {r.point for r in rows if "tolerance" in r.why} == {"c_3", "c_4"}  # 0.9 ok, 0.85 ruled out
    assert kept == {r.point for r in rows if r.kept} and all(r.why for r in rows if r.kept)


def test_keep_chooses_jointly_over_domains_and_calibrations():
    rows = [ScreenRow(f"c_{v}", "c", "emad", "margin", v, cal, dom, flops, {}, [], f"{cal}{dom}{v}")
            for v, flops in ((0, 0.5), (1, 0.8), (2, 1.0)) for cal in ("a", "b") for dom in ("x", "y")]
    kept = keep(rows, {"c": 2}, 0.85)
    assert all(r.kept == (r.point in kept) for r in rows)  # a kept value is kept on every cell
    assert kept == {"c_0", "c_2", "c_1"}


def test_costly_points_are_those_at_or_above_the_bound_on_every_domain():
    from emad.evaluation.screen import costly

    rows = _cells({0: (0.5, 1.2), 1: (1.0, 1.1), 2: (1.3, 0.99)})
    assert costly(rows, 1.0) == {("c_1", "a")}  # c_0 and c_2 spend less than full depth on one domain
    assert costly(rows, 0.9) == {("c_1", "a"), ("c_2", "a")}


def _cells(table: dict) -> list[ScreenRow]:
    """Rows of sweep ``c`` from ``{value: (FLOPs on domain x, FLOPs on domain y)}`` (nothing ruled out)."""
    return [ScreenRow(f"c_{v:g}", "c", "emad", "margin", v, "a", dom, f, {}, [], f"{dom}{v}")
            for v, both in table.items() for dom, f in zip(("x", "y"), both)]


def test_keep_brackets_the_target_on_every_cell_not_only_on_the_mean():
    # the mean crosses 0.85 between values 2 and 3; domain y alone crosses it between values 1 and 2
    rows = _cells({0: (0.5, 0.5), 1: (0.6, 0.8), 2: (0.7, 0.9), 3: (1.0, 1.0), 4: (1.0, 1.01)})
    keep(rows, {"c": 2}, 0.85)
    assert {r.point for r in rows if "target" in r.why} == {"c_1", "c_2", "c_3"}  # y: 0.8 | 0.9; mean: 0.8 | 1.0


def test_a_wide_target_bracket_on_one_cell_is_refined_even_where_the_mean_is_close():
    from emad.evaluation.screen import refinements

    # the mean steps 0.04 at most, but domain y jumps 0.1 across the target between values 1 and 2
    rows = _cells({0: (0.78, 0.78), 1: (0.84, 0.80), 2: (0.82, 0.90), 3: (0.86, 0.92)})
    assert refinements(rows, 0.85) == {"c": [1.2, 1.4, 1.6, 1.8]}  # REFINE_VALUES between 1 and 2
    assert refinements(_cells({0: (0.8, 0.8), 1: (0.84, 0.84), 2: (0.88, 0.88)}), 0.85) == {}


def _cfg(points: dict, n_layers: int | None = None, auto: dict | None = None, table: str = "baselines"):
    raw = {**BASE, "baselines": {}, "points": {}, table: points}
    return validate_section("decode", raw, DecodeConfig,
                            None if n_layers is None else {"n_layers": n_layers, "auto": auto or {}})


@pytest.mark.parametrize("knob, culprit", [
    ({"threshold": {"from": 2, "to": 1}}, "decode.baselines.c.threshold: from = 2 is above to = 1"),
    ({"threshold": {"from": 0, "to": 1, "points": 1}}, "decode.baselines.c.threshold.points: 1"),
    ({"threshold": {"from": 0, "to": "auto"}}, "decode.baselines.c.threshold.to: auto is the profile's largest tau"),
    ({"threshold": {"from": 0, "to": 1, "step": 3}}, "decode.baselines.c.threshold: unknown range key(s) step"),
    ({"threshold": {"from": 0, "to": 1, "spacing": "log"}}, "decode.baselines.c.threshold.spacing"),
    ({"threshold": "all"}, "decode.baselines.c.threshold: 'all' sweeps a layer knob"),
    ({"threshold": 0.5, "min_exit_layer": {"from": 1, "to": 2}}, "decode.baselines.c.min_exit_layer: a list or "
                                                                  "range sweeps the method's knob only"),
    ({"threshold": 0.5, "min_exit_layer": "0.5X"}, "decode.baselines.c.min_exit_layer: '0.5X' is neither"),
    ({"threshold": 0.5, "min_exit_layer": "1.5L"}, "the fraction of L must be in (0, 1]"),
])
def test_bad_ranges_and_relative_layers_name_the_key_before_any_work(knob, culprit):
    with pytest.raises(ConfigError) as err:
        _cfg({"c": {"method": "confidence", **knob}})
    assert culprit in str(err.value)


FORMS = "is either a range {from: ..., to: ..., points: ...} (its values: null), screened, or lists its values"


@pytest.mark.parametrize("knob, culprit", [
    ({"from": 0, "to": 1, "points": 8, "values": 0.5}, "decode.baselines.c.threshold.values: 0.5 is not a list"),
    ({"from": [0, 1], "to": 1}, "decode.baselines.c.threshold.from: [0, 1]: a list where the range needs one value"),
    ({"from": 0, "to": 1, "points": [4, 8]}, "decode.baselines.c.threshold.points: [4, 8]: a list where the range"),
    ({"values": [0.5, 1], "step": 2}, "decode.baselines.c.threshold: unknown key(s) step"),
    ({"points": 8, "values": None}, "decode.baselines.c.threshold: a range needs from and to"),
])
def test_a_range_mixed_with_a_list_wrongly_names_the_key_and_both_forms(knob, culprit):
    with pytest.raises(ConfigError) as err:
        _cfg({"c": {"method": "confidence", "threshold": knob}})
    assert culprit in str(err.value) and f"decode.baselines.c.threshold {FORMS}" in str(err.value)
    assert "dvc exp run -S 'decode.baselines.c.threshold.values=[0.5,1]'" in str(err.value)


def test_a_ranges_values_sweep_exactly_those_values_as_a_list_does():
    """``-S 'decode.points.emad.margin.values=[0.5,1]'`` on the default params' range: the range keys stay beside
    the values (DVC's override cannot remove them) and are not read; null values leave the range screened."""
    ranged = {"from": 0, "to": "auto", "points": 8, "spacing": "linear"}
    for n_layers in (None, 4):
        auto = None if n_layers is None else {"e": 2.0}
        listed = _cfg({"e": {"method": "emad", "margin": {**ranged, "values": [0.5, 1]}}}, n_layers, auto, "points")
        plain = _cfg({"e": {"method": "emad", "margin": [0.5, 1]}}, n_layers, auto, "points")
        assert listed.names_of("point") == plain.names_of("point") == ["e_0.5", "e_1"]
        assert listed.curves == plain.curves and not listed.screens
        assert listed.point("point", "e_1") == plain.point("point", "e_1")
        screened = _cfg({"e": {"method": "emad", "margin": {**ranged, "values": None}}}, n_layers, auto, "points")
        assert set(screened.screens) == {"e"}
    depth = _cfg({"f": {"method": "fixed", "depth": {"from": 1, "to": "L-1", "values": [2, "L-1"]}}}, 6)
    assert depth.names_of("baseline") == ["f_2", "f_5"]  # layers relative to L resolve as in a list
    with pytest.raises(ConfigError, match=r"decode\.points\.e\.margin\.values: the value 1.0 is listed twice"):
        _cfg({"e": {"method": "emad", "margin": {**ranged, "values": [1, 1.0]}}}, table="points")


def test_a_range_on_a_method_without_a_knob_is_named():
    with pytest.raises(ConfigError, match=r"decode.baselines.f.depth: a list or range sweeps the method's knob only "
                                          r"\(method 'full': no knob\)"):
        _cfg({"f": {"method": "full", "depth": {"from": 1, "to": 3}}})


def test_ranges_and_relative_layers_resolve_per_model_and_lists_stay_as_given():
    shaped = _cfg({"fixed": {"method": "fixed", "depth": "all"},
                   "conf": {"method": "confidence", "threshold": [0.5, 1], "min_exit_layer": "0.5L"}})
    assert shaped.screens["fixed"].values == [] and "conf_0.5" in shaped.baselines  # no model: checked only
    for n_layers in (4, 6):
        cfg = _cfg({"fixed": {"method": "fixed", "depth": "all"},
                    "conf": {"method": "confidence", "threshold": [0.5, 1], "min_exit_layer": "0.5L"}}, n_layers)
        assert cfg.names_of("baseline") == [f"fixed_{d}" for d in range(1, n_layers)] + ["conf_0.5", "conf_1"]
        assert cfg.point("baseline", "conf_1").min_exit_layer == n_layers // 2
        assert cfg.curve_of("baseline", "fixed_2").screened and not cfg.curve_of("baseline", "conf_1").screened
    grid = _cfg({"e": {"method": "emad", "margin": {"from": 0, "to": "auto", "points": 3, "grid": 5}}}, 4,
                {"e": 2.0}, table="points")
    assert grid.screens["e"].values == [0, 0.5, 1, 1.5, 2] and grid.screens["e"].points == 3
    logs = _cfg({"c": {"method": "confidence", "threshold": {"from": 0.01, "to": 1, "spacing": "log", "grid": 3,
                                                                 "points": 2}}}, 4)
    assert logs.screens["c"].values == [0.01, 0.1, 1]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2):
    """Two tiny models of different depths (4 and 6 layers), each with a profile, and one toy corpus."""
    root = tmp_path_factory.mktemp("screen")
    corpus = root / "corpora" / "toy"
    corpus.mkdir(parents=True)
    docs = [{"id": str(i), "text": TEXT[i * 5:], "n_tokens": 0} for i in range(3)]
    (corpus / "eval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (corpus / "manifest.json").write_text(json.dumps({"manifest_sha256": "toy"}))
    for n in (4, 6):
        save_tiny_pretrained(root / f"tiny{n}", smollm2.tokenizer, n_layers=n)
        save_tiny_profiles(root / f"tiny{n}", [TEXT] * 2, root / f"tiny{n}" / "toy" / "logit" / "profile.json")
    return root


def _decode(root: Path, model: str, params: dict, monkeypatch, out: str) -> Path:
    import pipeline.decode as stage

    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump({"decode": params, "calibrate": {"sources": ["toy"]}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    runs = root / out / model
    assert stage.main(["--kind", "baseline", "--kind", "point", "--model", model, "--model-dir", str(root / model),
                       "--corpora", str(root / "corpora"), "--calibration", "toy",
                       "--profile", str(root / model / "{calibration}" / "{readout}" / "profile.json"),
                       "--out", str(runs), "--artifacts", str(root / out / "art"), "--params", str(path)]) == 0
    return runs


def test_models_of_two_depths_run_the_same_default_shaped_params_and_keep_screened_values(models, monkeypatch):
    for n in (4, 6):
        runs = _decode(models, f"tiny{n}", SHAPED, monkeypatch, "shaped")
        records = runfile.load_all(runs)
        screens = {p.stem: json.loads(p.read_text()) for p in (runs / "screens").glob("*.json")}
        assert set(screens) == {"fixed", "conf", "emad"}
        fixed = screens["fixed"]["rows"]
        assert [r["value"] for r in fixed] == list(range(1, n))  # `all`: every depth below L, for this model
        for curve, screen in screens.items():
            kept = {r["point"] for r in screen["rows"] if r["kept"]}
            ran = {r["point"] for r in records if r["curve"] == curve}
            assert ran == kept  # only kept values became runs
            assert curve == "fixed" or len(kept) < len(screen["rows"])  # (fixed: fewer depths than points)
            exits = [r["exits"] for r in screen["rows"] if r["kept"]]
            assert len(exits) == len(set(exits))  # kept values differ in their exit decisions
            by_point = {r["point"]: r for r in records}
            for row in screen["rows"]:
                if row["kept"]:  # the screen's numbers are the run's teacher-forced numbers
                    run = by_point[row["point"]]
                    assert row["quality"]["perplexity"] == run["quality"]["perplexity"]
                    assert row["quality"]["agreement.token_agreement"] == run["quality"]["agreement.token_agreement"]
        conf = next(r for r in records if r["curve"] == "conf")
        assert conf["options"]["min_exit_layer"] == n // 2  # 0.5L of this model
        for r in records:
            if r["cost"].get("speed_timing", "").startswith("none: violates"):
                assert r["free_prompts"] == 0 and "fidelity" not in r["tasks"] and r["cost"]["speedup"] is None
                assert "rules the point out" in r["not_run"]["fidelity"]
            elif r["cost"]["speed_timing"].endswith("it can decide neither C1 nor C2"):  # >= 1 on every domain
                assert r["free_prompts"] == 1 and r["cost"]["flops_ratio"] >= 1
            elif r["cost"]["speed_timing"].startswith("cheap: FLOPs ratio"):
                assert r["free_prompts"] is None


def test_a_screened_value_scores_as_that_value_alone(models, monkeypatch):
    runs = _decode(models, "tiny4", {**SHAPED, "baselines": {"conf": SHAPED["baselines"]["conf"]}, "points": {}},
                   monkeypatch, "grid")
    rows = json.loads((runs / "screens" / "conf.json").read_text())["rows"]
    value = rows[len(rows) // 2]["value"]
    alone = {**SHAPED["baselines"]["conf"], "threshold": [value]}  # a hand-written list: exactly its value
    single = _decode(models, "tiny4", {**SHAPED, "baselines": {"conf": alone}, "points": {}}, monkeypatch, "alone")
    (record,) = runfile.load_all(single)
    row = next(r for r in rows if r["value"] == value)
    assert record["value"] == value and not (single / "screens").exists()
    assert row["quality"]["perplexity"] == record["quality"]["perplexity"]
    assert row["quality"]["agreement.token_agreement"] == record["quality"]["agreement.token_agreement"]


def test_a_cliff_beside_the_target_or_the_crossing_is_screened_again_between_its_values():
    from emad.evaluation.screen import MAX_GAP, REFINE_VALUES, refinements

    # FLOPs 1.0, 0.98, then a cliff to 0.6 between values 2 and 3 (the target 0.85 lies in it); lossless above 0.9
    rows = [_row(v, f, f"e{v}", f < 0.9) for v, f in ((1, 1.0), (2, 0.98), (3, 0.6), (4, 0.55))]
    new = refinements(rows, 0.85)
    assert list(new) == ["c"] and len(new["c"]) == REFINE_VALUES and all(2 < v < 3 for v in new["c"])
    assert refinements(rows, 0.85, layer_knobs=["threshold"]) == {}  # a layer knob's grid is every layer already
    close = [_row(v, 1.0 - 0.04 * v, f"e{v}", v > 2) for v in range(6)]  # neighbours at most 0.04 apart
    assert all(abs(a.flops_ratio - b.flops_ratio) <= MAX_GAP for a, b in zip(close, close[1:]))
    assert refinements(close, 0.85) == {}


def test_a_refinement_is_screened_on_every_domain_by_one_decoder(models, monkeypatch):
    """One worker screens every domain: values a refinement adds while screening the first domain are screened on
    the second too, and run there; the run phase drops the screen's passes before it decodes."""
    import shutil

    import pipeline.decode as stage
    from emad.evaluation.decoder import Decoder

    corpora = models / "corpora"
    if not (corpora / "toy2").exists():
        shutil.copytree(corpora / "toy", corpora / "toy2")
    params = {**BASE, "domains": {"toy": BASE["domains"]["toy"], "toy2": BASE["domains"]["toy"]},
              "baselines": {"full": {"method": "full"},
                            "conf": {"method": "confidence", "probe_every": 1,
                                     "threshold": {"from": 0.05, "to": 50, "points": 2, "grid": 2}}}, "points": {}}
    path = models / "two-domains.yaml"
    path.write_text(yaml.safe_dump({"decode": params}))
    call = stage.plan(stage.parse_args(["--kind", "baseline", "--model", "tiny4", "--model-dir",
                                        str(models / "tiny4"), "--corpora", str(corpora), "--out", str(models / "o"),
                                        "--artifacts", str(models / "a"), "--params", str(path)]))
    decoder, phases = Decoder(call), stage.Phases(call)
    first = [decoder.screen(d) for d in call.domains]
    extra = phases._at("conf", 7.5)
    again = [decoder.screen(d, extra) for d in call.domains]
    assert [{r.value for r in rows} for rows in first] == [{0.05, 50.0}] * 2
    assert [[(r.point, r.domain) for r in rows] for rows in again] == [[("conf_7.5", d)] for d in call.domains]
    assert all(decoder._kept[d] for d in call.domains)  # the passes the refinement reused
    timed = decoder._speeds
    held = []  # per domain, at its timing: whether its screen's passes were still held

    def speeds(domain, *args):
        held.append(domain in decoder._kept)
        return timed(domain, *args)

    monkeypatch.setattr(decoder, "_speeds", speeds)
    trims = []  # the run phase hands the heap's free pages back after each point
    monkeypatch.setattr("emad.evaluation.decoder.release_free", lambda min_interval=0.0: trims.append(min_interval))
    outcomes = [decoder.run(d, frozenset({"conf_7.5"}), extra) for d in call.domains]
    assert [sorted(o.label for o in out) for out in outcomes] == [["conf_7.5", "full"]] * 2
    assert held == [False, False]  # dropped before the run phase decodes: it reads their scores only
    assert trims == [1.0] * 4  # two points on each domain, at most once a second


def test_a_screen_in_batches_keeps_the_points_one_request_a_pass_keeps(models, monkeypatch):
    """The default-shaped screen scored 16 requests a pass and one request a pass: the same rows (exit decisions,
    FLOPs, what rules a value out; quality to float rounding), the same kept points, the same runs."""
    one = _decode(models, "tiny4", {**SHAPED, "sweep_batch": 1}, monkeypatch, "batch1")
    many = _decode(models, "tiny4", {**SHAPED, "sweep_batch": 16, "sweep_batch_tokens": None}, monkeypatch, "batch16")
    names = sorted(p.name for p in (one / "screens").glob("*.json"))
    assert names and names == sorted(p.name for p in (many / "screens").glob("*.json"))
    for name in names:
        a, b = (json.loads((runs / "screens" / name).read_text())["rows"] for runs in (one, many))
        assert [(r["point"], r["exits"], r["flops_ratio"], r["ruled_out"], r["kept"]) for r in a] == \
               [(r["point"], r["exits"], r["flops_ratio"], r["ruled_out"], r["kept"]) for r in b]
        for x, y in zip(a, b):
            assert x["quality"] == pytest.approx(y["quality"], rel=1e-5)
    assert sorted(r["run_id"] for r in runfile.load_all(one)) == sorted(r["run_id"] for r in runfile.load_all(many))
