"""EMAD: entropy-guided adaptive-depth decoding of LLMs.

The names a notebook needs, importable from here (each is loaded on first use, so ``import emad`` stays cheap)::

    from emad import load_model, LayerStack, PointConfig, build_method, generate, score_adaptive

    lm = load_model("smollm2-135m")
    stack = LayerStack(lm.model)
    method = build_method(PointConfig(method="confidence", threshold=1.0), stack.n_layers, lm.fingerprint.as_dict())
    out = generate(stack, lm.tokenizer, [lm.tokenizer("The sun").input_ids], method, max_new_tokens=20)
    print(out.texts[0], out.cost_ratio())

The subpackages follow the data flow: :mod:`emad.engine` (models, layer stack, cache, cost) →
:mod:`emad.exits` (criteria, estimators, policies, strata) → :mod:`emad.calibration` (statistics, profiles) →
:mod:`emad.decode` (the loop) and :mod:`emad.methods` (strategies) → :mod:`emad.tasks` →
:mod:`emad.evaluation` (operating points, runs, risk control) → :mod:`emad.report`; :mod:`emad.lm_eval` plugs
the model into lm-eval.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "emad.engine.models": ["load_model", "LoadedModel", "prepare_model"],
    "emad.engine.stack": ["LayerStack"],
    "emad.engine.cost": ["CostModel"],
    "emad.exits.criteria": ["CRITERIA", "Criterion"],
    "emad.exits.estimators": ["ESTIMATORS"],
    "emad.exits.policies": ["POLICIES"],
    "emad.exits.readouts": ["READOUTS", "TunedLens", "load_readout"],
    "emad.calibration.calibrate": ["calibrate", "calibrate_texts"],
    "emad.calibration.stats": ["CalibrationStats"],
    "emad.calibration.profile": ["Profile", "smooth"],
    "emad.decode": ["Generation", "Method", "Sampling", "Scored", "generate", "score", "score_adaptive",
                    "score_sweep", "Sweep"],
    "emad.methods": ["STRATEGIES"],
    "emad.tasks.registry": ["TASKS"],
    "emad.evaluation.operating_point": ["PointConfig", "build_method"],
}


def lazy_exports(package: str, namespace: dict[str, Any], exports: dict[str, list[str]]):
    """``(__all__, __getattr__, __dir__)`` for a package whose public names are imported on first use: each name
    of ``exports`` (module → names) is looked up in its module when first asked for, then kept in ``namespace``
    (the package's globals)."""
    where = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *where])

    return sorted(where), getattr_, dir_


__all__, __getattr__, __dir__ = lazy_exports("emad", globals(), _EXPORTS)
