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


def test_family_marks_the_readout_unless_logit_and_the_estimator_unless_exact_and_splits_back():
    assert family_of("emad") == "emad" and family_of("emad", "tuned") == "emad+tuned"
    assert family_of("emad", "logit", "exact") == "emad" and family_of("emad", "tuned", "topk") == "emad+tuned:topk"
    assert split_family("emad+tuned") == ("emad", "tuned", None) and split_family("emad") == ("emad", "logit", None)
    assert split_family("confidence:lowrank") == ("confidence", "logit", "lowrank")
    for family in ("emad", "emad+tuned", "emad/emad+tuned", "fixed", "emad:topk", "emad+tuned:lowrank"):
        assert family_of(*split_family(family)) == family


def test_curve_of_a_run_names_its_family_and_profile():
    run = {"model": "m", "family": "emad+tuned:topk", "readout": "tuned", "calibration": "prose", "domain": "code",
           "options": {"estimator": "topk"}}
    cid = CurveId.of_run(run)
    assert cid == CurveId("m", "emad", "tuned", "topk", "prose", "code")
    assert (cid.family, cid.profile) == ("emad+tuned:topk", "prose+tuned")
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
