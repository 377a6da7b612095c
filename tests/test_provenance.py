"""Where a unit was computed: recorded per unit, and units computed under different settings are not merged."""

from __future__ import annotations

import pytest
import torch

from emad.evaluation.provenance import MUST_AGREE, check_mergeable, provenance, record_mix


def test_provenance_names_the_host_settings_versions_and_revision():
    p = provenance(torch.device("cpu"), torch.float32, "host:1 node x")
    assert {"host", "worker", "ray_node", "device", "dtype", "gpu", "torch_threads", "cpu", "torch", "transformers",
            "code_revision"} <= set(p)
    assert (p["device"], p["dtype"], p["worker"]) == ("cpu", "float32", "host:1 node x")
    assert p["torch_threads"] == torch.get_num_threads() and p["torch"] == torch.__version__
    assert p["ray_node"] is None and len(p["code_revision"]) in (40, 7) or p["code_revision"] == "unknown"


def test_units_under_differing_dtype_are_refused_by_name():
    a = provenance("cpu", torch.float32, "a")
    b = {**a, "worker": "b", "dtype": "bfloat16"}
    check_mergeable([("prose on a", a), ("code on a", {**a, "worker": "a2", "host": "elsewhere"})])  # fine
    with pytest.raises(ValueError, match=r"dtype: float32 \(prose on a\); bfloat16 \(code on b\)"):
        check_mergeable([("prose on a", a), ("code on b", b)])
    assert set(MUST_AGREE) == {"device", "dtype", "torch_threads", "gpu", "torch", "transformers", "code_revision"}


def test_units_differing_in_gpu_versions_or_code_are_refused_by_name_unless_the_mix_is_asked_for(monkeypatch):
    a = provenance("cpu", torch.float32, "a")
    for key, other in (("transformers", "4.0.0"), ("torch", "2.0.0"), ("code_revision", "0" * 40),
                       ("gpu", "NVIDIA A100, 80 GiB")):
        with pytest.raises(ValueError, match=rf"{key}: .* \(code on b\).*EMAD_ALLOW_MIXED_UNITS=1"):
            check_mergeable([("prose on a", a), ("code on b", {**a, "worker": "b", key: other})])
    monkeypatch.setenv("EMAD_ALLOW_MIXED_UNITS", "1")
    b = {**a, "worker": "b", "transformers": "4.0.0"}
    mix = check_mergeable([("prose on a", a), ("code on b", b)])
    assert mix.startswith(f"transformers: {a['transformers']} (prose on a); 4.0.0 (code on b)")
    record_mix([a, b], mix)
    assert a["mixed"] == b["mixed"] == mix
    from emad.report.render import mixed_units_markdown

    assert mixed_units_markdown([{"provenance": a}, {"provenance": {}}]) == [
        f"**Mixed settings.** Units computed under different settings were merged on request "
        f"(EMAD_ALLOW_MIXED_UNITS=1): {mix}."]


def test_provenance_records_the_gpu_off_cuda_as_none():
    assert provenance("cpu", torch.float32)["gpu"] is None
