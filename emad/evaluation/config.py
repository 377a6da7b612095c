"""The ``decode`` section of params.yaml: eval domains and their tasks, operating points, ablations."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from emad.config import Section, validate_section
from emad.engine.engines import check_engine
from emad.evaluation.checks import MIN_SPEED_PROMPTS
from emad.evaluation.operating_point import PointConfig
from emad.evaluation.sweeps import Screen, SweepPosition, expand_table, knob_of
from emad.evaluation.units import CONFIRMATION, indices
from emad.tasks.registry import TASKS, Task

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")  # keys of decode.speed_tokens_by_device
NAME = r"^[A-Za-z0-9_-]+$"  # DVC addresses params by dotted keys: names may not contain dots


def _names_ok(kind: str, names) -> None:
    bad = [n for n in names if not re.match(NAME, n)]
    if bad:
        raise ValueError(f"{kind} names may hold only letters, digits, '-' and '_' (no dots): {bad}")


class DecodeConfig(Section):
    """Params of the decode stages.

    Attributes:
        domains: eval domain → the tasks run on it (text tasks read ``data/corpus/<domain>/eval.jsonl``).
        tasks: task → its settings (see ``emad.tasks.registry``; missing keys take the task's defaults).
        baselines: operating points without a profile (full, fixed, confidence): one run per model × domain.
        points: operating points with a profile (emad): one run per model × calibration source × domain.
        default_point: the EMAD point the ablations start from (a name in ``points``).
        ablations: name → the options changed from ``default_point`` (one factor each).
        ablation_domains: domains the ablations run on (each also in ``domains``).
        ablation_tasks: the tasks the ablations run, each among every ablation domain's tasks (null = all of
            them).
        ablation_calibration: the calibration source whose profiles the ablations read (one of
            ``calibrate.sources``), and the points outside ``shift_points``; its fitted estimators
            (``estimators.json``) serve every point with a fitted estimator.
        shift_points: the points (or sweeps) of ``points`` run with the profiles of every calibration source (the
            domain-shift matrix); the others read those of ``ablation_calibration`` only (null: every point).
        related: methods from related work without a profile (softmax response, contrastive, EAD, speculative
            decoding ...): one run per model × related domain.
        related_domains: domains the related methods run on (each also in ``domains``).
        related_tasks: the tasks the related methods run, each among every related domain's tasks (null = all).
        heatmap_texts: generated texts shown in a run's token-depth heat map.
        swept_prompts: prompts (problems) each free-running task (fidelity, gsm8k, humaneval) of a swept point that
            never exits decodes: the first of its task's own (null = all); so does a screened point whose
            teacher-forced FLOPs ratio is at least ``speed_flops_below`` and the verdict's target on every domain (it
            can decide neither C1 nor C2); one the teacher-forced screen rules out decodes none; the teacher-forced
            tasks score them all.
        unserved_tokens: scored perplexity tokens for points the sweep scorer cannot serve (policies other than
            monotone, EAD with a second model): they score token by token (null =
            ``decode.tasks.perplexity.tokens``).
        speed_repeats: timed generations per point, each beside a full-depth one of the same prompts (speed-up =
            the median of their tokens/s ratios; 0 = no speed measurement): the cheap measure of points a
            teacher-forced check already rules out, or that never exit.
        speed_prompts: distinct prompts (of each domain's first task with speed prompts, e.g. fidelity's) on which
            every other point is timed, one pair (point and full depth back to back) per prompt, ``speed_tokens``
            new tokens each: C2's 95% interval over prompts rests on them (at least
            :data:`~emad.evaluation.checks.MIN_SPEED_PROMPTS`).
        speed_tokens_by_device: ``speed_tokens`` on a device type (``cuda: 64``): where a step takes a fraction of
            a millisecond, generations long enough that the prompt's pass is a minority of their time.
        speed_flops_below: only points whose teacher-forced FLOPs ratio (per domain) is below this are timed over
            prompts; the others, which compute at least this share of full depth's FLOPs, get the cheap measure
            (null: every point that exits early and that no teacher-forced check rules out).
        speed_candidates: C2's candidates timed over prompts per family and domain: the cheapest (teacher-forced
            FLOPs ratio, placed on the selection half) first; the rest get the cheap measure (null: every one).
        split_seed: the seed of the units' split (:mod:`emad.evaluation.units`): the screen, point placement and
            C2's early stop choose on the selection half of each task's units, the verdict judges the other half;
            recorded in each run file.
        curves: filled from the points' value lists (not set by hand): expanded point → its :class:`SweepPosition`.
        screens: filled from the points' ranges (not set by hand): screened sweep → its :class:`Screen` (its grid
            resolved only when validated for one model: :meth:`for_model`).
        executor: who runs the work units (one per domain): ``serial`` (this process) or ``ray`` (actors on the
            cluster ``RAY_ADDRESS`` names, or on Ray started inside the stage); ``$EMAD_DECODE_EXECUTOR`` overrides
            it; the stage checks the name before any work. Outputs are the same either way
            (:mod:`emad.evaluation.executors`).
        workers: Ray actors (null: one per GPU of the cluster, else 2).
        sweep_batch: requests the screen's sweep scores in one pass (:mod:`emad.decode.batches`: longest first,
            requests with one prompt together); a request's scores do not depend on its batch-mates beyond float
            rounding. ``auto``: as many as ``sweep_batch_tokens`` lets a pass hold, or without it a quarter of the
            free memory.
        sweep_batch_tokens: at most this many padded tokens a sweep pass (its continuations × its longest prompt and
            continuation): the memory bound (null: none).

    A point of ``baselines``, ``points`` or ``related`` may give a list, a range or ``all`` for its method's knob
    (``margin``, ``threshold``, ``depth``, ``tau``, ``exit_layer``): a list stands for one point per value, a range
    for the points its screen keeps, a range whose ``values`` are set for those values as a list; layer fields may be
    relative to the model's depth (``0.7L``) (:mod:`emad.evaluation.sweeps`).
        device, dtype: where and how the model runs.
        engine: how decode steps run: ``auto`` (compiled on CUDA, eager on CPU), ``eager`` or ``compiled``
            (segments between probes compiled over static caches, CUDA graphs on CUDA: :mod:`emad.engine.compiled`);
            ``compiled-if`` / ``compiled-lookahead`` ask for how a CUDA step takes its later blocks
            (:mod:`emad.engine.engines`); the same tokens, depths and costs on any.
    """

    domains: dict[str, list[str]] = Field(min_length=1)
    tasks: dict[str, dict[str, Any]] = Field(default_factory=dict)
    baselines: dict[str, PointConfig] = Field(default_factory=dict)
    points: dict[str, PointConfig] = Field(default_factory=dict)
    default_point: str | None = None
    ablations: dict[str, dict[str, Any]] = Field(default_factory=dict)
    ablation_domains: list[str] = Field(default_factory=list)
    ablation_tasks: list[str] | None = None
    ablation_calibration: str = "stdlib-prose"
    shift_points: list[str] | None = None
    related: dict[str, PointConfig] = Field(default_factory=dict)
    related_domains: list[str] = Field(default_factory=list)
    related_tasks: list[str] | None = None
    heatmap_texts: int = Field(3, ge=0)
    swept_prompts: int | None = Field(None, ge=1)
    unserved_tokens: int | None = Field(None, ge=2)
    speed_repeats: int = Field(3, ge=0)
    speed_prompts: int = MIN_SPEED_PROMPTS
    speed_tokens: int = Field(32, ge=1)
    speed_tokens_by_device: dict[str, int] = Field(default_factory=dict)
    speed_flops_below: float | None = Field(1.0, gt=0)
    speed_candidates: int | None = Field(None, ge=1)
    split_seed: int = Field(0, ge=0)
    curves: dict[str, SweepPosition] = Field(default_factory=dict)
    screens: dict[str, Screen] = Field(default_factory=dict)
    executor: str = "serial"
    workers: int | None = Field(None, ge=1)
    sweep_batch: int | str = 16
    sweep_batch_tokens: int | None = 4096
    device: str = "auto"
    dtype: str = "auto"
    engine: str = "auto"

    @model_validator(mode="before")
    @classmethod
    def _expand_sweeps(cls, data: Any, info: ValidationInfo) -> Any:
        """Replace each swept point by its points and record their curves and screens (errors name the point and
        field); with a validation context ``{"n_layers": L, "auto": {sweep: largest tau}}`` layers and ranges
        resolve for that model (:meth:`for_model`)."""
        if not isinstance(data, dict):
            return data
        for filled in ("curves", "screens"):
            if filled in data:
                raise ValueError(f"decode.{filled} is filled from the points' sweeps; remove it from params")
        context = info.context or {}
        data, curves, screens, owner = dict(data), {}, {}, {}
        for table in ("baselines", "points", "related"):
            if isinstance(data.get(table), dict):
                data[table], found, screened = expand_table(table, data[table], context.get("n_layers"),
                                                            context.get("auto"))
                for name in data[table]:
                    if name in owner and (name in found or name in curves):
                        raise ValueError(f"decode.{table}: point {name!r} (from a sweep) is also in "
                                         f"decode.{owner[name]}; rename one of them")
                    owner[name] = table
                curves.update(found)
                screens.update(screened)
        return {**data, "curves": curves, "screens": screens}

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_engine(value)

    @model_validator(mode="after")
    def _sweep_batch(self) -> DecodeConfig:
        from emad.decode.batches import check_batch  # no torch: the params check stays light

        check_batch(self.sweep_batch, self.sweep_batch_tokens)
        return self

    @field_validator("speed_tokens_by_device")
    @classmethod
    def _device_speed_tokens(cls, value: dict[str, int]) -> dict[str, int]:
        for device, tokens in value.items():
            if device not in DEVICE_TYPES:
                raise ValueError(f"decode.speed_tokens_by_device: {device!r} is not a device type "
                                 f"({', '.join(DEVICE_TYPES)})")
            if tokens < 2:
                raise ValueError(f"decode.speed_tokens_by_device.{device} = {tokens}: a timed generation needs at "
                                 f"least 2 new tokens (one decode step)")
        return value

    @field_validator("speed_prompts")
    @classmethod
    def _enough_speed_prompts(cls, value: int) -> int:
        if value < MIN_SPEED_PROMPTS:
            raise ValueError(f"decode.speed_prompts = {value} is below the {MIN_SPEED_PROMPTS} distinct prompts per "
                             f"domain the verdict's C2 needs (its interval is over prompts); set it to at least "
                             f"{MIN_SPEED_PROMPTS}")
        return value

    @field_validator("domains")
    @classmethod
    def _known_tasks(cls, domains: dict[str, list[str]]) -> dict[str, list[str]]:
        _names_ok("domain", domains)
        for domain, tasks in domains.items():
            unknown = [t for t in tasks if t not in TASKS]
            if unknown or not tasks:
                raise ValueError(f"domain {domain!r}: unknown or no tasks {unknown}; valid: {', '.join(TASKS.names())}")
        return domains

    @field_validator("tasks")
    @classmethod
    def _task_settings(cls, tasks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, raw in tasks.items():
            TASKS.get(name).settings(raw)  # unknown names and bad settings fail here, with their path
        return tasks

    @model_validator(mode="after")
    def _speed_prompts_exist(self) -> DecodeConfig:
        """Every domain has a task that gives speed prompts (C2 is judged on every domain: one without them could
        only leave C2 unmeasured), and each such task (fidelity) has at least ``speed_prompts`` of them in the
        confirmation half (C2 times that half, under ``split_seed``)."""
        timed = sorted(n for n in TASKS.names() if type(TASKS.get(n)()).speed_prompts is not Task.speed_prompts)
        for domain, tasks in self.domains.items():
            if not any(t in timed for t in tasks):
                add = "fidelity" if "fidelity" in timed else timed[0]
                raise ValueError(f"decode.domains.{domain}: none of its tasks ({', '.join(tasks)}) gives the prompts "
                                 f"C2 times a point on; add one of {', '.join(timed)} (e.g. {domain}: "
                                 f"[{', '.join([*tasks, add])}])")
        for name in sorted({t for tasks in self.domains.values() for t in tasks}):
            task = TASKS.get(name)()
            have = getattr(task.settings(self.tasks.get(name)), "prompts", None)
            if type(task).speed_prompts is not Task.speed_prompts and have is not None:
                judged = len(indices(have, CONFIRMATION, self.split_seed, name))
                if judged < self.speed_prompts:
                    raise ValueError(
                        f"decode.tasks.{name}.prompts = {have} gives {judged} prompts in the confirmation half, fewer "
                        f"than decode.speed_prompts = {self.speed_prompts} (C2 times one pair per distinct prompt of "
                        f"{name}'s confirmation half): raise it to at least {2 * self.speed_prompts}")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> DecodeConfig:
        tables = {"baselines": self.baselines, "points": self.points, "ablations": self.ablations,
                  "related": self.related}
        _names_ok("point", [self.curves[n].curve if n in self.curves else n for t in tables.values() for n in t])
        for name, point in self.baselines.items():
            if point.needs_profile or point.is_strategy:
                home = "points" if point.needs_profile else "related"
                raise ValueError(f"baselines.{name}: method {point.method!r} belongs under {home}")
        for name, point in self.points.items():
            if not point.needs_profile:
                raise ValueError(f"points.{name}: method {point.method!r} uses no profile; list it under baselines")
        for name, point in self.related.items():
            if point.needs_profile:
                raise ValueError(f"related.{name}: method {point.method!r} needs a profile; list it under points")
        seen: dict[str, str] = {}
        for table, names in tables.items():
            for name in names:
                if name in seen:
                    raise ValueError(f"point names must be unique across {', '.join(tables)}: {name!r} is in "
                                     f"{seen[name]} and {table}")
                seen[name] = table
        sweeps = {self.curves[n].curve if n in self.curves else n for n in self.points}
        stray = [n for n in self.shift_points or [] if n not in sweeps]
        if stray:
            raise ValueError(f"shift_points {stray} are not points or sweeps of points "
                             f"({', '.join(sorted(sweeps)) or 'none'})")
        stray = [d for d in self.related_domains if d not in self.domains]
        if stray:
            raise ValueError(f"related_domains {stray} are not in domains ({', '.join(self.domains)})")
        if self.ablations:
            if self.default_point not in self.points:
                raise ValueError(f"default_point {self.default_point!r} must name one of points: "
                                 f"{', '.join(self.points) or 'none'}")
            for name in self.ablations:
                self.ablation(name)
            stray = [d for d in self.ablation_domains if d not in self.domains]
            if stray:
                raise ValueError(f"ablation_domains {stray} are not in domains ({', '.join(self.domains)})")
        for kind in ("ablation", "related"):
            for domain in getattr(self, f"{kind}_domains"):
                stray = [t for t in getattr(self, f"{kind}_tasks") or [] if t not in self.domains[domain]]
                if stray:
                    raise ValueError(f"{kind}_tasks {stray} are not tasks of {kind} domain {domain!r} "
                                     f"({', '.join(self.domains[domain])})")
        return self

    def ablation(self, name: str) -> PointConfig:
        """The default point with ablation ``name``'s options changed."""
        if name not in self.ablations:
            raise ValueError(f"unknown ablation {name!r}; valid: {', '.join(self.ablations) or 'none'}")
        base = self.points[self.default_point].model_dump()
        return validate_section(f"decode.ablations.{name}", {**base, **self.ablations[name]}, PointConfig)

    def names_of(self, kind: str) -> list[str]:
        """Every point name of ``kind`` (``baseline``, ``point``, ``ablation`` or ``related``)."""
        return list({"baseline": self.baselines, "point": self.points, "ablation": self.ablations,
                     "related": self.related}[kind])

    def point(self, kind: str, name: str) -> PointConfig:
        """The operating point ``name`` of ``kind`` (``baseline``, ``point``, ``ablation`` or ``related``)."""
        if kind == "ablation":
            return self.ablation(name)
        table = {"baseline": self.baselines, "point": self.points, "related": self.related}[kind]
        if name not in table:
            raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(table) or 'none'}")
        return table[name]

    def domains_of(self, kind: str, chosen: list[str] | None = None) -> list[str]:
        """The eval domains a point of ``kind`` runs on (``chosen``, when given, must be among them)."""
        own = {"ablation": self.ablation_domains, "related": self.related_domains}.get(kind, list(self.domains))
        stray = [d for d in chosen or [] if d not in own]
        if stray:
            table = {"ablation": "decode.ablation_domains", "related": "decode.related_domains"}.get(
                kind, "decode.domains")
            raise ValueError(f"--domain {', '.join(map(repr, stray))}: not in {table} ({', '.join(own) or 'none'})")
        return list(chosen) if chosen else list(own)

    def tasks_of(self, kind: str, domain: str) -> list[str]:
        """The tasks a point of ``kind`` runs on ``domain`` (``ablation_tasks`` / ``related_tasks`` when set)."""
        narrow = {"ablation": self.ablation_tasks, "related": self.related_tasks}.get(kind)
        return [t for t in self.domains[domain] if not narrow or t in narrow]

    def curve_of(self, kind: str, name: str) -> SweepPosition:
        """The :class:`SweepPosition` of point ``name``: its sweep's, or its own (its knob's value) when not swept."""
        if name in self.curves:
            return self.curves[name]
        point = self.point(kind, name)
        knob = knob_of(point.method)
        value = getattr(point, knob) if knob else None
        return SweepPosition(curve=name, knob=knob, value=None if value is None else float(value))

    def shifts(self, name: str) -> bool:
        """Point ``name`` runs with every calibration source's profiles (``shift_points``)."""
        return self.shift_points is None or name in self.shift_points or (
            name in self.curves and self.curves[name].curve in self.shift_points)

    def is_swept(self, name: str) -> bool:
        return name in self.curves

    def select(self, kind: str, chosen: list[str] | None) -> list[str]:
        """The point names of ``kind`` a stage runs: ``chosen`` (a sweep's name stands for all its points) or every
        one; unknown names are an error listing the valid ones."""
        names = self.names_of(kind)
        if not chosen:
            return names
        out = []
        for c in chosen:
            found = [n for n in names if n == c or (n in self.curves and self.curves[n].curve == c)]
            if not found:
                raise ValueError(f"--point {c!r}: not a {kind} point or sweep; valid: {', '.join(names) or 'none'}")
            out += [n for n in found if n not in out]
        return out

    def task_settings(self, name: str):
        return TASKS.get(name).settings(self.tasks.get(name))
