"""The whole params.yaml, checked before any stage works: every section by its typed model, then across sections.

A stage reads only its own section (:func:`load_section`), but a typo anywhere in the file fails the
first stage in seconds rather than the stage that reads it after an hour of calibration. Errors name the full
parameter path, the value given and what is allowed.

The sections of operating points (``decode``, ``risk``, ``control.decode``) are checked by building each point's
criterion, estimator and strategy, which imports torch; a stage that touches no model (``sample_corpus``,
``smooth``, ``aggregate``) checks every other section (``points=False``) and starts without torch. Every stage
that loads a model checks them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import AfterValidator, Field, RootModel, StringConstraints, field_validator

from emad.calibration.config import CalibrateConfig, EstimatorsConfig, ReadoutsConfig, SmoothConfig
from emad.config import ConfigError, Section, read_params, validate_section
from emad.corpus.config import CorpusConfig
from emad.engine.idle_spec import parse_idle_spec
from emad.report.config import AggregateConfig

if TYPE_CHECKING:
    from emad.evaluation.config import DecodeConfig

S = TypeVar("S", bound=Section)

NAME = r"^[A-Za-z0-9_-]+$"  # DVC addresses params by dotted keys: names may not contain dots


def _spec(value: str) -> str:
    if not value.strip():
        raise ValueError("a model spec must be an embedded alias, a local folder or a hub id, not empty")
    parse_idle_spec(value)  # a +idle<N> suffix must carry a positive integer
    return value


class ModelsConfig(RootModel[dict[Annotated[str, StringConstraints(pattern=NAME)], Annotated[str, AfterValidator(_spec)]]]):
    """The ``models`` section: name → spec (embedded alias, local folder or hub id, optionally ``+idle<N>``)."""


class ControlConfig(Section):
    """The ``control`` section: the positive control, a model with known redundant depth run at small scope beside
    the models, on which early exit must win (:mod:`emad.engine.idle`).

    Attributes:
        model: its name (folders, run ids, the report), e.g. ``smollm2-135m+idle30``.
        spec: a model with idle layers appended, ``<base spec>+idle<N>`` (the base an embedded alias, a local
            folder or a hub id).
        base: the model of ``models`` that ``spec`` grows (its spec is ``spec`` less ``+idle<N>``): the control's
            readouts are that model's fit, extended to the idle layers (bit for bit what a fit on the control
            gives, :func:`emad.calibration.readout_fit.grown_fit`).
        source: its one calibration source (readouts, profiles and estimators are fitted on it), one of
            ``calibrate.sources``; ``readouts.source`` and ``decode.ablation_calibration``, where the base model's
            readouts and estimators are fitted.
        decode: its decode section: ``domains``, ``baselines`` and ``points`` of its own, the other keys of
            :data:`CONTROL_INHERITS` from ``decode`` unless given; it runs no ablations and no related methods, and
            every point reads the profiles of ``source``.
    """

    model: str = Field(pattern=r"^[A-Za-z0-9_+-]+$")
    spec: str
    base: str
    source: str = "stdlib-prose"
    decode: dict[str, Any] = Field(default_factory=dict)

    @field_validator("spec")
    @classmethod
    def _idle(cls, value: str) -> str:
        if parse_idle_spec(value) is None:
            raise ValueError(f"{value!r} has no idle layers: the control is a model with known redundant depth, "
                             f"<base spec>+idle<N> (e.g. smollm2-135m+idle30)")
        return value


CONTROL_OWN = ("domains", "baselines", "points")  # the control's decode gives these itself
CONTROL_INHERITS = ("tasks", "heatmap_texts", "swept_prompts", "unserved_tokens", "speed_repeats", "speed_prompts",
                    "speed_tokens", "speed_flops_below", "speed_candidates", "split_seed", "sweep_batch",
                    "sweep_batch_tokens", "executor", "workers", "device", "dtype",
                    "engine")  # ... and takes these from decode (its DVC params)


def control_decode(raw: dict[str, Any], context: dict | None = None) -> DecodeConfig:
    """The control's decode section: ``control.decode`` over the keys of ``decode`` it inherits
    (:data:`CONTROL_INHERITS`; no ablations, no related methods). Errors name ``control.decode.<key>``."""
    own = (raw.get("control") or {}).get("decode") or {}
    missing = [k for k in CONTROL_OWN if k not in own]
    if missing:
        raise ConfigError(f"control.decode: give {', '.join(missing)} (the control's own; it inherits only "
                          f"decode.{', decode.'.join(CONTROL_INHERITS)})")
    base = {k: v for k, v in (raw.get("decode") or {}).items() if k in CONTROL_INHERITS}
    from emad.evaluation.config import DecodeConfig  # its points import torch (module docstring)

    return validate_section("control.decode", {**base, **own}, DecodeConfig, context)


def load_decode(path: str | Path = "params.yaml", control: bool = False, context: dict | None = None
                ) -> DecodeConfig:
    """The decode section (``control``: the control's, :func:`control_decode`) after checking the whole file;
    ``context`` (``{"n_layers": L, "auto": {sweep: largest tau}}``) resolves its layers and ranges for one model
    (:mod:`emad.evaluation.sweeps`)."""
    from emad.evaluation.config import DecodeConfig

    if not control:
        cfg = load_section("decode", DecodeConfig, path)
        return cfg if context is None else validate_section("decode", read_params(path).get("decode"),
                                                             DecodeConfig, context)
    validate_params(path)
    raw = read_params(path)
    if not raw.get("control"):
        raise ConfigError(f"params file {path}: no control section (control.model, control.source, control.decode)")
    return control_decode(raw, context)


POINT_SECTIONS = ("decode", "risk")
"""The sections of operating points: checked by building their points (torch; the module docstring)."""


def sections(points: bool = True) -> dict[str, type[Section] | type[RootModel]]:
    """Section name → its typed model (``points=False``: without :data:`POINT_SECTIONS`, importing no torch)."""
    known = {"models": ModelsConfig, "control": ControlConfig, "corpus": CorpusConfig, "readouts": ReadoutsConfig,
             "calibrate": CalibrateConfig, "smooth": SmoothConfig, "estimators": EstimatorsConfig}
    if points:
        from emad.evaluation.config import DecodeConfig
        from emad.evaluation.risk_config import RiskConfig

        known.update(decode=DecodeConfig, risk=RiskConfig)
    return {**known, "aggregate": AggregateConfig}


def validate_params(path: str | Path = "params.yaml", points: bool = True) -> dict[str, Any]:
    """Every section present in the params file as its typed model, after the cross-section checks.

    Sections left out take their defaults where the stage that reads them has any; a check across two sections
    runs when both are present. ``points=False`` leaves out the sections of operating points (:data:`POINT_SECTIONS`,
    and ``control.decode``) and the checks that read them: what a stage that touches no model checks.

    Raises:
        ConfigError: an unknown section, an invalid value (full path, value, rule), or a name used in one section
            that another section must define (e.g. a calibration source that is not sampled).
    """
    raw = read_params(path)
    known = sections(points)
    unknown = sorted(set(raw) - set(known) - (set() if points else set(POINT_SECTIONS)))
    if unknown:
        valid = ", ".join(sections()) if points else ", ".join([*known, *POINT_SECTIONS])
        raise ConfigError(f"params file {path}: unknown section(s) {', '.join(unknown)}; valid: {valid}")
    cfg = {name: validate_section(name, raw[name], known[name]) for name in known if name in raw}
    _check_across({**cfg, "control.decode": control_decode(raw)} if "control" in cfg and points else cfg)
    return cfg


def _check_across(cfg: dict[str, Any]) -> None:
    if "models" in cfg and not cfg["models"].root:
        raise ConfigError("models: name at least one model (name: spec), e.g. smollm2-135m: smollm2-135m")
    if "corpus" not in cfg:
        return
    sampled = set(cfg["corpus"].sources)
    for i, source in enumerate(cfg["calibrate"].sources if "calibrate" in cfg else []):
        if source not in sampled:
            raise ConfigError(f"calibrate.sources[{i}]: {source!r} is not sampled; add it to corpus.sources "
                              f"({', '.join(sorted(sampled))})")
    calibrated = cfg.get("calibrate", CalibrateConfig()).sources
    profiled = cfg.get("calibrate", CalibrateConfig()).readouts
    for i, readout in enumerate(cfg["estimators"].readouts if "estimators" in cfg else []):
        if readout not in profiled:
            raise ConfigError(f"estimators.readouts[{i}]: {readout!r} has no profile; valid: calibrate.readouts "
                              f"({', '.join(profiled)})")
    if "decode" in cfg and cfg["decode"].ablations:
        _check_calibrated("decode.ablation_calibration", cfg["decode"].ablation_calibration, calibrated)
    if "risk" in cfg and cfg["risk"].searches:
        _check_calibrated("risk.calibration", cfg["risk"].calibration, calibrated)
    _check_readouts(cfg)
    if "risk" in cfg and cfg["risk"].searches and cfg["risk"].domain not in sampled:
        raise ConfigError(f"risk.domain: {cfg['risk'].domain!r} is not sampled; add it to corpus.sources "
                          f"({', '.join(sorted(sampled))})")
    if "control" in cfg:
        _check_calibrated("control.source", cfg["control"].source, calibrated)
        _check_control_base(cfg)
    for section in ("decode", "control.decode"):
        for domain, tasks in cfg[section].domains.items() if section in cfg else []:
            if domain not in sampled:
                raise ConfigError(f"{section}.domains.{domain}: the domain is not sampled; add it to "
                                  f"corpus.sources ({', '.join(sorted(sampled))})")
            for task in tasks:
                from emad.tasks.registry import TASKS  # a decode section was checked: its tasks are imported

                items = TASKS.get(task).corpus_items
                if items is not None and not cfg["corpus"].tasks.builds(domain, items):
                    raise ConfigError(f"{section}.domains.{domain}: task {task!r} reads items that sample_corpus "
                                      f"builds only when corpus.tasks.{items} is set and corpus.tasks.sources "
                                      f"(null: all) holds {domain!r}")


def _check_calibrated(key: str, source: str, calibrated: list[str]) -> None:
    if source not in calibrated:
        raise ConfigError(f"{key}: {source!r} is not a calibration source; valid: calibrate.sources "
                          f"({', '.join(calibrated)})")


def _check_control_base(cfg: dict[str, Any]) -> None:
    """The control grows one of the models, and is calibrated where that model's readouts are fitted."""
    control, models = cfg["control"], cfg["models"].root if "models" in cfg else None
    grown = parse_idle_spec(control.spec)[0]
    if models is not None and models.get(control.base) != grown:
        named = [name for name, spec in models.items() if spec == grown]
        raise ConfigError(f"control.base: {control.base!r} is not the model of models that control.spec "
                          f"({control.spec!r}) grows; valid: a model whose spec is {grown!r}"
                          f"{f' ({named[0]})' if named else ' (add it to models)'}")
    for key, source in (("readouts.source", cfg.get("readouts", ReadoutsConfig()).source),
                        ("decode.ablation_calibration", cfg["decode"].ablation_calibration if "decode" in cfg else
                         control.source)):
        if control.source != source:
            raise ConfigError(f"control.source: {control.source!r} must be {key} ({source!r}): the control's "
                              f"readouts and estimators are its base model's, fitted there, extended to the idle "
                              f"layers")


def _check_readouts(cfg: dict[str, Any]) -> None:
    """The readouts serve what calibration and decoding ask of them: they are fitted on a calibration source (one
    fit per model serves every source and point), and a tuned profile's probe layers all have translators."""
    calibrate = cfg.get("calibrate", CalibrateConfig())
    readouts = cfg.get("readouts", ReadoutsConfig())
    if readouts.source not in calibrate.sources:
        raise ConfigError(f"readouts.source: {readouts.source!r} is not a calibration source; readouts are fitted "
                          f"on one of calibrate.sources ({', '.join(calibrate.sources)})")
    probes, layers = calibrate.probe_layers, readouts.layers
    missing = set(probes) - set(layers) if isinstance(probes, list) and isinstance(layers, list) else None
    covered = probes == layers or (missing is not None and missing <= {max(probes)})  # L needs no translator
    if "tuned" in calibrate.readouts and not covered:
        raise ConfigError(f"readouts.layers = {layers!r} must cover calibrate.probe_layers = {probes!r} when "
                          f"calibrate.readouts includes tuned (the same spec, or a list holding every probe layer)")
    if "corpus" in cfg and ("readouts" in cfg or "tuned" in calibrate.readouts):  # a fit that will run
        _check_readout_tokens(cfg["corpus"].calib_tokens, calibrate, readouts)


def _check_readout_tokens(calib_tokens: int, calibrate: CalibrateConfig, readouts: ReadoutsConfig) -> None:
    """The calibration split holds the fit's three disjoint ranges (training, selection, held-out) and, when a
    tuned profile is calibrated, its ``calibrate.max_tokens`` before them."""
    fit = readouts.tokens + readouts.selection + readouts.holdout
    ranges = (f"readouts.tokens + readouts.selection + readouts.holdout = {readouts.tokens} + "
              f"{readouts.selection} + {readouts.holdout} = {fit}")
    if calib_tokens < fit:
        raise ConfigError(f"corpus.calib_tokens = {calib_tokens} must hold {ranges} (the fit's training, selection "
                          f"and held-out tokens, disjoint): raise corpus.calib_tokens to at least {fit} or lower "
                          f"those three")
    if "tuned" not in calibrate.readouts:
        return
    needed = (calibrate.max_tokens or 0) + fit
    if calibrate.max_tokens is None or calib_tokens < needed:
        raise ConfigError(f"corpus.calib_tokens = {calib_tokens} must hold calibrate.max_tokens "
                          f"({calibrate.max_tokens}) + {ranges}, {needed} in all, when calibrate.readouts includes "
                          f"tuned: the translators are fitted on the split's last tokens and the profiles on its "
                          f"first max_tokens, so a tuned profile never reads the tokens its translators were fitted "
                          f"on (set calibrate.max_tokens; valid: corpus.calib_tokens >= {needed})")


def load_section(name: str, model: type[S], path: str | Path = "params.yaml", points: bool = True) -> S:
    """Section ``name`` of the params file as ``model``, after checking the whole file (:func:`validate_params`;
    ``points=False``: a stage that touches no model, every section but the operating points')."""
    validate_params(path, points)
    return validate_section(name, read_params(path).get(name), model)
