"""The identity of a curve (emad.evaluation.identity): one value type, its family, profile and run names."""

from __future__ import annotations

from emad.evaluation.identity import (
    CurveId,
    family_of,
    point_folder,
    point_label,
    profile_in_domain,
    run_id,
    split_family,
)


def test_family_marks_the_readout_estimator_and_probe_stride_unless_default_and_splits_back():
    assert family_of("emad") == "emad" and family_of("emad", "tuned") == "emad+tuned"
    assert family_of("emad", "logit", "exact") == "emad" and family_of("emad", "tuned", "topk") == "emad+tuned:topk"
    assert family_of("emad", "tuned", "topk", 2) == "emad+tuned:topk/2" and family_of("emad", probe_stride=2) == "emad/2"
    assert split_family("emad+tuned") == ("emad", "tuned", None, 1) and split_family("emad") == ("emad", "logit", None, 1)
    assert split_family("confidence:lowrank") == ("confidence", "logit", "lowrank", 1)
    assert split_family("emad+tuned:topk/2") == ("emad", "tuned", "topk", 2)
    for family in ("emad", "emad+tuned", "fixed", "emad:topk", "emad+tuned:lowrank", "emad+tuned:topk/2", "emad/3"):
        assert family_of(*split_family(family)) == family


def test_curve_of_a_run_names_its_family_and_profile():
    run = {"model": "m", "family": "emad+tuned:topk", "readout": "tuned", "calibration": "prose", "domain": "code",
           "options": {"estimator": "topk"}}
    cid = CurveId.of_run(run)
    assert cid == CurveId("m", "emad", "tuned", "topk", 1, "prose", "code")
    assert (cid.family, cid.profile) == ("emad+tuned:topk", "prose+tuned")
    every2nd = CurveId.of_run({**run, "family": "emad+tuned:topk/2"})
    assert (every2nd.probe_stride, every2nd.family, every2nd.profile) == (2, "emad+tuned:topk/2", "prose+tuned")
    assert not cid.in_domain and cid.calibrated_on("code").in_domain
    assert cid.on(None).in_domain and cid.on(None).domain is None
    plain = CurveId.of_run({"model": "m", "family": "fixed", "calibration": "", "domain": "code"})
    assert (plain.family, plain.readout, plain.calibration, plain.profile) == ("fixed", "logit", None, None)
    assert plain.in_domain


def test_profile_keys_read_back_their_source():
    assert profile_in_domain("prose+tuned", "prose") and profile_in_domain("prose", "prose")
    assert not profile_in_domain("prose+tuned", "code") and profile_in_domain(None, "code")


def test_point_names_match_the_run_file_ids():
    assert point_folder("emad_1", None) == "emad_1" and point_folder("emad_1", "prose") == "emad_1--cal-prose"
    assert point_label("emad_1", "prose") == "emad_1@prose" and point_label("full", None) == "full"
    assert run_id("m", "emad_1", "code", None) == "m--emad_1--code"
    assert run_id("m", "emad_1", "code", "prose") == "m--emad_1--cal-prose--code"


def test_a_points_family_carries_its_estimator_and_probe_stride():
    from emad.evaluation.operating_point import PointConfig

    point = PointConfig(method="emad", margin=1.0, readout="tuned", estimator="topk", probe_stride=2)
    assert point.family == "emad+tuned:topk/2"
    assert PointConfig(method="emad", margin=1.0, probe_stride=1).family == "emad"
