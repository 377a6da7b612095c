"""Where a unit was computed: recorded per unit, and units computed under different settings are not merged."""

from __future__ import annotations

import pytest
import torch

from emad.evaluation.provenance import MUST_AGREE, check_mergeable, provenance


def test_provenance_names_the_host_settings_versions_and_revision():
    p = provenance(torch.device("cpu"), torch.float32, "host:1 node x")
    assert {"host", "worker", "ray_node", "device", "dtype", "torch_threads", "cpu", "torch", "transformers",
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
    assert set(MUST_AGREE) == {"device", "dtype", "torch_threads"}
