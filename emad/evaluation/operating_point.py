"""An operating point as data: the options that name a method, checked once and built into a :class:`Method`.

The CLI flags, a ``decode.points`` entry of params.yaml and lm-eval's ``model_args`` all become a
:class:`PointConfig`, and :func:`build_method` turns it into criterion × policy × estimator for a loaded model —
checking the profile and fitted estimators against the model before any decoding — or into a strategy
(:data:`emad.methods.STRATEGIES`: ``ead``, ``speculative``).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError, ValidationInfo, field_validator, model_validator

from emad.calibration import estimator_fit
from emad.calibration.profile import Profile, variant_path
from emad.config import Section
from emad.decode import Method
from emad.decode.step import check_pairing
from emad.decode.strategy import Strategy
from emad.evaluation.identity import family_of
from emad.exits.batching import BATCH_EXITS, check_batch_exit
from emad.exits.criteria import CRITERIA
from emad.exits.estimators import ESTIMATORS
from emad.exits.policies import POLICIES
from emad.exits.readouts import READOUTS, load_readout
from emad.exits.strata import VARIANTS
from emad.methods import STRATEGIES


def _one_of(kind: str, names: list[str], value: str) -> str:
    if value not in names:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(names)}")
    return value


_NAMED: dict[str, tuple[str, Callable[[], list[str]]]] = {  # field -> (what it names, its valid names)
    "method": ("method", lambda: method_names()),
    "policy": ("policy", POLICIES.names),
    "estimator": ("estimator", ESTIMATORS.names),
    "readout": ("readout", READOUTS.names),
    "batch_exit": ("batch exit", BATCH_EXITS.names),
    "strata": ("strata variant", lambda: list(VARIANTS)),
}


class PointConfig(Section):
    """One operating point. ``method`` picks the criterion or strategy; the other fields are its options (unused
    ones ignored).

    Strategy options: ``ead`` — ``tau`` (τ, nats), ``small`` (a second model's spec) or ``small_layers`` (k: the
    target's own first k layers), ``window`` (w), ``d_min``, ``start``; ``speculative`` — ``drafter`` (``self`` or a
    second model's spec), ``exit_layer`` (E, for ``self``), ``draft_policy`` (static, adaedl, confidence),
    ``max_draft`` (N), ``gamma``, ``lam``, ``target_acceptance``, ``beta``, ``eta`` (AdaEDL), ``draft_confidence``.

    The profile is not an option: it is given with the point (a path), so one point runs against every profile.
    ``strata`` picks a stratification of that profile (``strata/<variant>.json`` beside it, written by the smooth
    stage); None uses the profile as given. ``readout`` (``logit`` or ``tuned``) is how probe layers are read out,
    for every criterion, the self drafter's exit layer and the EAD self pair's k; ``tuned`` needs a readouts file
    (stage ``fit_readouts``) and a profile calibrated through it. ``batch_exit`` (``per-row`` or ``sync``,
    :mod:`emad.exits.batching`) is when the rows of a batch step leave: each where it may exit, or all together at
    the first probe where every one may; ``sync`` is for exit criteria (strategies decode rows one at a time).
    """

    method: str = "full"
    depth: int | None = None
    threshold: float | None = None
    probe_every: int | None = None
    probe_stride: int | None = None
    margin: float | None = None
    min_exit_layer: int | None = None
    policy: str = "monotone"
    estimator: str = "exact"
    strata: str | None = None
    readout: str = "logit"
    batch_exit: str = "per-row"
    layer_thresholds: dict[int, float] | None = None
    alpha: float | None = None
    alpha_rate: float | None = None
    distance_discount: float | None = None
    contrast_weight: float | None = None
    contrastive_output: bool | None = None
    prune_k: int | None = None
    prune_schedule: str | None = None
    prune_k_min: int | None = None
    # strategies (unset: the strategy's defaults)
    tau: float | None = None
    small: str | None = None
    small_layers: int | None = None
    window: int | None = None
    d_min: int | None = None
    start: str | None = None
    drafter: str | None = None
    exit_layer: int | None = None
    draft_policy: str | None = None
    max_draft: int | None = None
    gamma: float | None = None
    lam: float | None = None
    target_acceptance: float | None = None
    beta: float | None = None
    eta: float | None = None
    draft_confidence: float | None = None

    @field_validator(*_NAMED)
    @classmethod
    def _known_name(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind, names = _NAMED[info.field_name]
        return v if v is None else _one_of(kind, names(), v)

    @model_validator(mode="after")
    def _options_valid(self) -> PointConfig:
        """Check the options' values now (a params typo costs seconds): the strategy's, the criterion's where it
        needs no profile, the batch exit with the policy, and an estimator built from the point."""
        given = self._given(_init_params(self.method))
        if self.is_strategy:
            if self.batch_exit != "per-row":
                raise ValueError(f"batch_exit {self.batch_exit!r} applies to exit criteria, not to method "
                                 f"{self.method!r}: a strategy decodes its rows one at a time; drop batch_exit or "
                                 f"pick a criterion ({', '.join(CRITERIA.names())})")
            STRATEGIES.get(self.method).check_options(**given)
        else:
            check_batch_exit(self.batch_exit, self.policy)
            if not self.needs_profile:
                CRITERIA.get(self.method).from_options(**given)
        if not ESTIMATORS.get(self.estimator).needs_fit:
            ESTIMATORS.get(self.estimator)(**self._given(_estimator_params(self.estimator)))
        return self

    @property
    def needs_profile(self) -> bool:
        return "profile" in _init_params(self.method)

    @property
    def family(self) -> str:
        """The method family as reports group it: the method, marked with its readout unless ``logit``, with its
        entropy estimator unless ``exact`` and with its probe stride unless 1 (``emad``, ``emad+tuned``,
        ``emad:topk``, ``emad:topk/2``), so verdicts and figures read family × readout × estimator × probes."""
        estimates = not self.is_strategy and CRITERIA.get(self.method).needs_estimate
        return family_of(self.method, self.readout, self.estimator if estimates else None, self.probe_stride or 1)

    @property
    def is_strategy(self) -> bool:
        return self.method in STRATEGIES

    def options(self) -> dict[str, Any]:
        """The options that matter for this method (for run files, MLflow params and ablation tables)."""
        out = {"method": self.method, **self._given(_init_params(self.method) - {"profile"})}
        if not self.is_strategy and CRITERIA.get(self.method).needs_estimate:
            out.update(policy=self.policy, estimator=self.estimator, **self._given(_estimator_params(self.estimator)))
        if self.needs_profile and self.strata is not None:
            out["strata"] = self.strata
        if self.readout != "logit":
            out["readout"] = self.readout
        if self.batch_exit != "per-row":
            out["batch_exit"] = self.batch_exit
        return out

    def _given(self, names: set[str]) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if k in names and v is not None}


def point_from_options(options: dict[str, Any], what: str) -> PointConfig:
    """A :class:`PointConfig` from loose options (CLI flags, lm-eval model_args); errors name each option, the value
    given and the rule, prefixed by ``what`` (e.g. ``"emad model_args"``)."""
    try:
        return PointConfig(**options)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(map(str, e["loc"]))
            given = e.get("input") if where else None
            head = f"{where}={given!r}: " if where else ""
            problems.append(head + e["msg"].removeprefix("Value error, "))
        raise ValueError(f"{what}: " + "; ".join(problems)) from None


def method_names() -> list[str]:
    """Every method a point may name: exit criteria and strategies."""
    return sorted([*CRITERIA.names(), *STRATEGIES.names()])


def _estimator_params(name: str) -> set[str]:
    """The options an estimator built from the point (not from a fitted file) reads."""
    cls = ESTIMATORS.get(name)
    return set() if cls.needs_fit else set(inspect.signature(cls.__init__).parameters) - {"self"}


def _init_params(method: str) -> set[str]:
    """The options a method reads: its criterion's constructor arguments, or its strategy's ``from_options``."""
    fn = STRATEGIES.get(method).from_options if method in STRATEGIES else CRITERIA.get(method).__init__
    return set(inspect.signature(fn).parameters) - {"self", "cls", "load"}


def build_method(point: PointConfig, n_layers: int, fingerprint: dict, profile_path: str | Path | None = None,
                 estimators_path: str | Path | None = None,
                 load: Callable[[str], tuple[Any, Any]] | None = None,
                 readouts_path: str | Path | None = None) -> Method | Strategy:
    """The :class:`Method` (or strategy) of ``point`` for a model with ``n_layers`` layers and the given fingerprint.

    Args:
        profile_path: profile.json for methods that need one.
        estimators_path: fitted estimators (default: ``estimators.json`` beside the profile).
        load: ``load(spec) -> (LayerStack, tokenizer)`` for a strategy's second model (``small``, ``drafter``).
        readouts_path: readouts.safetensors (stage fit_readouts) for ``readout: tuned``.

    Raises:
        ValueError: a missing option, a missing/mismatched profile, estimator or readouts file — before any
            decoding.
    """
    if point.is_strategy:
        strategy = STRATEGIES.get(point.method).from_options(load=load, **point._given(_init_params(point.method)))
        strategy.validate(n_layers)
        strategy.readout = load_readout(point.readout, readouts_path, fingerprint, strategy.readout_layers(n_layers),
                                        n_layers)
        return strategy
    profile = None
    if point.needs_profile:
        if profile_path is None:
            raise ValueError(f"method {point.method!r} needs a profile (profile.json from the smooth stage)")
        if not Path(profile_path).is_file():
            raise FileNotFoundError(f"profile {profile_path} does not exist (run the calibrate and smooth stages, "
                                    "or `emad calibrate`)")
        chosen = profile_file(profile_path, point.strata)
        profile = Profile.load(chosen)
        profile.check_model(fingerprint)
        if profile.readout != point.readout:
            raise ValueError(f"profile {chosen} was calibrated through the {profile.readout!r} readout, but the "
                             f"point reads out through {point.readout!r}: calibrate with readout "
                             f"{point.readout!r} (emad calibrate --readout {point.readout}) and use that profile")
    options = {**point.model_dump(exclude={"method", "policy", "estimator", "strata", "readout", "batch_exit"}),
               "profile": profile}  # Profile object
    criterion = CRITERIA.get(point.method).from_options(**options)
    criterion.validate(n_layers)
    estimator_cls = ESTIMATORS.get(point.estimator)
    check_pairing(criterion, estimator_cls)
    if not estimator_cls.needs_fit:
        estimator = estimator_cls(**point._given(_estimator_params(point.estimator)))
    else:
        fitted = estimators_path or (Path(profile_path).parent / "estimators.json" if profile_path else None)
        if fitted is None:
            raise ValueError(f"estimator {point.estimator!r} needs a fitted estimators file (stage fit_estimators: "
                             "data/estimators/<model>/<readout>.json; or estimators.json beside the profile)")
        estimator = _fitted(str(fitted), point.estimator, json.dumps(fingerprint, sort_keys=True, default=str),
                            tuple(criterion.probes(n_layers)))
    readout = load_readout(point.readout, readouts_path, fingerprint, criterion.probes(n_layers), n_layers)
    method = Method(criterion, point.policy, estimator, readout, point.batch_exit)
    method.validate(n_layers)
    return method


@functools.lru_cache(maxsize=32)
def _fitted(path: str, name: str, fingerprint: str, probes: tuple[int, ...]):
    """A fitted estimator, loaded once per process for every point that reads it (a sweep's values share it, so
    the sweep estimates once per probe for all of them)."""
    return estimator_fit.load(path, name, json.loads(fingerprint), list(probes))


def readout_path(path: str | Path | None, readout: str) -> Path | None:
    """``path`` with ``{readout}`` replaced by the point's readout (one DVC path template serves both readouts)."""
    return None if path is None else Path(str(path).replace("{readout}", readout))


def profile_file(profile_path: str | Path, strata: str | None) -> Path:
    """The profile file of the requested stratification (the given file when ``strata`` is None)."""
    if strata is None:
        return Path(profile_path)
    path = variant_path(profile_path, strata)
    if not path.is_file():
        found = sorted(p.stem for p in path.parent.glob("*.json"))
        raise FileNotFoundError(
            f"strata={strata!r}: no profile {path} (variants there: {', '.join(found) or 'none'}). The smooth stage "
            f"writes a variant only for axes the calibration used: set calibrate.strata.position_edges and/or "
            f"confidence_edges and rerun calibrate and smooth")
    return path


def model_loader(device: str = "auto", dtype: str = "auto") -> Callable[[str], tuple[Any, Any]]:
    """``load(spec) -> (LayerStack, tokenizer)`` for a strategy's second model, on the given device and dtype."""

    def load(spec: str):
        from emad.engine.models import load_model
        from emad.engine.stack import LayerStack

        loaded = load_model(spec, device=device, dtype=dtype)
        return LayerStack(loaded.model), loaded.tokenizer

    return load
