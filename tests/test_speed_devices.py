"""C2's interval pools speed pairs of one device: a point whose runs were timed on several is read on the device with
the most pairs, and the verdict names it and the pairs left out; on one device (or in run files that do not name
it) every pair is pooled, as before."""

from __future__ import annotations

import pytest

from emad.evaluation.intervals import ratio_interval
from emad.evaluation.speed_devices import device_name, run_device, split_by_device
from emad.report import metrics_summary, report_markdown
from emad.report.verdict import verdict
from tests.test_report import full_runs, point_runs, powered  # noqa: F401 (powered: a fixture)

GPU, CPU = "cuda: NVIDIA H200, 139 GiB", "cpu: AMD EPYC 7B13"
FAST = [1.30, 1.32, 1.29, 1.31, 1.30, 1.30, 1.31, 1.29, 1.33, 1.28, 1.30, 1.31]  # the majority device's ratios
SLOW = [0.90, 0.92, 0.88, 0.91, 0.90, 0.89, 0.91, 0.90]  # the other device's: pooled they would straddle the gain


def _point(code: list[float], prose: list[float], devices: dict[str, dict] | None = None) -> list[dict]:
    """Full depth and ``emad-a`` on code and prose, the point's pairs of each domain at the given ratios; ``devices``:
    per domain, fields set on the point's run (``cost.speed_device`` or ``provenance``)."""
    runs = full_runs()
    for r in point_runs("emad-a", flops=0.8, tps=130.0):
        r["cost"]["speed_pairs"] = [[100 * x, 100.0] for x in (code if r["domain"] == "code" else prose)]
        for key, value in (devices or {}).get(r["domain"], {}).items():
            if key == "provenance":
                r["provenance"] = value
            else:
                r["cost"][key] = value
        runs.append(r)
    return runs


def _pooled(*ratios: list[float]) -> object:
    return ratio_interval([x for rs in ratios for x in rs])


def test_device_names_come_from_the_speed_record_else_the_provenance_in_the_same_words():
    assert device_name("cuda:0", "NVIDIA H200, 139 GiB", "AMD EPYC 7B13") == GPU
    assert device_name("cpu", None, "AMD EPYC 7B13") == CPU
    assert run_device({"cost": {"speed_device": GPU}, "provenance": {"device": "cpu", "cpu": "x"}}) == GPU
    assert run_device({"cost": {}, "provenance": {"device": "cuda:1", "gpu": "NVIDIA H200, 139 GiB"}}) == GPU
    assert run_device({"cost": {}, "provenance": {"device": "cpu", "gpu": None, "cpu": "AMD EPYC 7B13"}}) == CPU
    assert run_device({"cost": {}}) is None


def test_the_device_with_the_most_pairs_is_judged_ties_by_name():
    runs = [{"domain": "a", "cost": {"speed_device": GPU, "speed_pairs": [[1, 1]] * 8}},
            {"domain": "b", "cost": {"speed_device": CPU, "speed_pairs": [[1, 1]] * 12}}]
    split = split_by_device(runs)
    assert split.mixed and split.judged == CPU and [r["domain"] for r in split.kept] == ["b"]
    assert split.left_out_summary() == [{"domain": "a", "run_id": None, "device": GPU, "pairs": 8}]
    runs[1]["cost"]["speed_pairs"] = [[1, 1]] * 8  # a tie: the first name in sorted order ("cpu: …" < "cuda: …")
    assert split_by_device(runs).judged == CPU


@pytest.mark.usefixtures("powered")
def test_a_point_timed_on_two_devices_is_judged_on_the_one_with_the_most_pairs():
    runs = _point(SLOW, FAST, {"code": {"speed_device": GPU, "load_avg": 7.5}, "prose": {"speed_device": CPU}})
    v = verdict(runs)["m"]
    (p,) = v.points
    assert p.speed == _pooled(FAST) != _pooled(SLOW, FAST)  # prose's 12 pairs alone, not all 20
    assert p.speed.n == 12 and p.speed_device == CPU and p.load_avg == 1.0  # the load beside the pairs read
    assert p.speed_left_out == [{"domain": "code", "run_id": next(r["run_id"] for r in runs if r["point"] == "emad-a"
                                                                  and r["domain"] == "code"),
                                 "device": GPU, "pairs": 8}]
    assert v.c2.passed  # the majority device's pairs clear the gain; pooled with the slow device's they would not
    text = v.c2.sentence()
    assert f"pairs timed on {CPU} only (left out: code's 8 pairs on {GPU})" in text
    assert p.to_dict()["speed_device"] == CPU
    assert metrics_summary(runs, {"m": v})["m"]["emad"]["speedup_device"] == CPU
    assert f"pairs timed on {CPU} only" in report_markdown(runs, {"m": v}, {}, [])


@pytest.mark.usefixtures("powered")
def test_old_run_files_are_named_by_their_provenance_and_split_alike():
    runs = _point(SLOW, FAST, {"code": {"provenance": {"device": "cuda:0", "gpu": "NVIDIA H200, 139 GiB"}},
                               "prose": {"provenance": {"device": "cpu", "gpu": None, "cpu": "AMD EPYC 7B13"}}})
    (p,) = verdict(runs)["m"].points
    assert p.speed == _pooled(FAST) and p.speed_device == CPU


@pytest.mark.usefixtures("powered")
@pytest.mark.parametrize("devices", [
    None,  # run files that name no device: one unnamed device
    {"code": {"speed_device": GPU}, "prose": {"speed_device": GPU}},
    {"code": {"speed_device": CPU}, "prose": {"provenance": {"device": "cpu", "gpu": None, "cpu": "AMD EPYC 7B13"}}},
])
def test_on_one_device_every_pair_is_pooled_and_the_text_names_no_device(devices):
    runs = _point(SLOW, FAST, devices)
    v = verdict(runs)["m"]
    (p,) = v.points
    assert p.speed == _pooled(SLOW, FAST) and p.speed.n == 20
    assert p.speed_device is None and not p.speed_left_out
    assert "speed_device" not in p.to_dict() and "pairs timed on" not in v.c2.sentence()
    assert "speedup_device" not in metrics_summary(runs, {"m": v})["m"]["emad"]
