"""The compute half of the decode stages: one model with every job's method bound, run one unit (domain) at a time.

A :class:`Decoder` is what a work unit needs: the model loaded once, every job's method built and bound, every
domain's tasks prepared. A unit runs in two phases. :meth:`Decoder.screen` scores the teacher-forced tasks of every
job in one sweep pass (:func:`emad.evaluation.evaluate.score_all`) and returns the screened sweeps' rows
(:class:`~emad.evaluation.screen.ScreenRow`); the driver chooses the values to keep
(:func:`emad.evaluation.screen.keep`, jointly over the domains); :meth:`Decoder.run` then gives each kept job its
free-running tasks, its speed-up against full depth in this process and its heat-map inputs, as plain values
(:class:`Outcome`) — the same whether the stage's own process or a Ray actor ran it
(:mod:`emad.evaluation.executors`); the stage writes them (run files, artifacts, MLflow).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from tqdm import tqdm

from emad.decode import Method
from emad.decode.batches import Batching
from emad.decode.strategy import Strategy
from emad.engine.engines import compile_stats, with_engine
from emad.engine.host_memory import release_free
from emad.engine.idle import final_state_from
from emad.engine.models import load_model
from emad.engine.stack import LayerStack
from emad.evaluation import identity
from emad.evaluation.checks import Thresholds, checks_against, screen
from emad.evaluation.config import DecodeConfig
from emad.evaluation.evaluate import Evaluation, evaluate, heatmap_inputs, prepare, score_all, score_shard
from emad.evaluation.identity import FULL
from emad.evaluation.judge import half_flops, passes_c2
from emad.evaluation.operating_point import (
    PointConfig,
    build_method,
    model_loader,
    profile_file,
    readout_path,
)
from emad.evaluation.proof import prove_identical
from emad.evaluation.provenance import provenance
from emad.evaluation.record import profile_facts, quality_of
from emad.evaluation.screen import ScreenRow
from emad.evaluation.shards import Shard, ShardScores
from emad.evaluation.speed import (
    measure_speedup,
    point_speedup,
    reference_speed,
    speed_prompts_of,
    time_prompts,
)
from emad.evaluation.sweeps import SweepPosition
from emad.evaluation.units import CONFIRMATION, SELECTION, Units, split_record
from emad.exits.criteria import Full
from emad.exits.estimators import ESTIMATORS
from emad.tasks.registry import Shared

REFERENCE = "full depth (reference)"  # scored beside the points when no full point runs with them
NEITHER = "on every domain: it can decide neither C1 nor C2"


class Untimed(StrEnum):
    """Why a point is not timed over prompts for C2."""

    FULL = "full depth"
    ABLATION = "an ablation (not judged)"
    RULED_OUT = "ruled out by the screen"
    NEVER_EXITS = "never exits"
    COSTLY = "FLOPs ratio at or above decode.speed_flops_below"
    DECIDED = "C2 decided"
    SPARE = "beyond decode.speed_candidates"


@dataclass(frozen=True)
class NotTimed:
    """Why a point is not timed for C2 (``kind``), in words (``text``); ``spare``: it can decide neither criterion
    on any domain."""

    kind: Untimed
    text: str
    spare: bool = False

    def __str__(self) -> str:
        return f"{self.text}; {NEITHER}" if self.spare else self.text


@dataclass
class Job:
    """One operating point with one calibration source's profile (None without a profile), ready to run."""

    kind: str
    name: str
    point: PointConfig
    calibration: str | None
    position: SweepPosition | None = None  # its sweep, knob and value (None: not swept)
    method: object = None
    facts: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Unique within a call: the point's name, with its calibration when it has one."""
        return identity.point_folder(self.name, self.calibration)


@dataclass(frozen=True)
class Sources:
    """Where a decode call's files are: the prepared model, sampled corpora, profiles, readouts and estimators
    (path templates as the stage's flags give them; see ``pipeline/decode.py``)."""

    model_dir: str
    corpora: Path | None = None
    profile: str | None = None
    readouts: str | None = None
    estimators: str | None = None


@dataclass(frozen=True)
class Plan:
    """A decode call, checked: its config, jobs (methods not yet built), domains and where its files are."""

    cfg: DecodeConfig
    jobs: tuple[Job, ...]
    tasks_of: dict[str, list[str]]  # domain -> the tasks its jobs run
    sources: Sources
    thresholds: Thresholds
    screens: dict[str, int] = field(default_factory=dict)  # screened sweep -> the points it keeps

    @property
    def domains(self) -> list[str]:
        return list(self.tasks_of)


@dataclass
class Outcome:
    """What one job gave on one domain, as plain values: the model's and method's facts, its results, cost
    (speed-up included), depth histogram and heat-map inputs; the stage turns it into a run file, artifacts and an
    MLflow run. ``host`` names the process that ran it (not part of the results); ``provenance`` says where and
    how it was computed (:mod:`emad.evaluation.provenance`)."""

    label: str
    domain: str
    fingerprint: str
    n_layers: int
    method: dict[str, Any]
    facts: dict[str, Any]
    tasks: dict[str, Any]
    cost: dict[str, Any]
    histogram: dict[int, int]
    heatmap: tuple  # (texts, prompts, full depth's texts): emad.report.heatmap.heatmap_html's inputs
    free_prompts: int | None
    settings: dict[str, Any]
    identity: dict[str, Any] = field(default_factory=dict)  # emad.evaluation.proof.prove_identical
    split: dict[str, Any] = field(default_factory=dict)  # emad.evaluation.units.split_record
    host: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)


class Decoder:
    """The model loaded once, every job's method built and bound (bad input fails here, before any decoding), every
    domain's tasks prepared; :meth:`screen` and :meth:`run` score one domain."""

    def __init__(self, plan: Plan):
        cfg, src = plan.cfg, plan.sources
        self.plan = plan
        self.loaded = load_model(src.model_dir, device=cfg.device, dtype=cfg.dtype)
        plain = LayerStack(self.loaded.model)
        self.final_from = final_state_from(plain)  # exits from here on read the final state (emad.engine.idle)
        self.stack = with_engine(plain, cfg.engine)
        self.speed_tokens = cfg.speed_tokens_by_device.get(self.stack.device.type, cfg.speed_tokens)
        self.jobs = [Job(j.kind, j.name, j.point, j.calibration, j.position) for j in plan.jobs]
        self._scores: dict[str, dict] = {}  # domain -> job label -> its teacher-forced scores (score_all)
        self._reference: dict[str, dict] = {}  # domain -> full depth's teacher-forced task results
        self._shared: dict[str, Shared] = {}  # domain -> what its tasks share across points
        self._kept: dict[str, dict] = {}  # domain -> its sweep passes, for the screen's refinements (Sweep.score)
        self._references: dict[tuple, float] = {}  # (prompts, new tokens) -> full depth's tokens/s (cheap measure)
        self._build_all()
        self.batching = Batching.of(cfg.sweep_batch, cfg.sweep_batch_tokens, self.stack,
                                    [job.method for job in self.jobs])
        self.prepared = {d: prepare(tasks, cfg.tasks, src.corpora / d if src.corpora else None,
                                    self.loaded.tokenizer) for d, tasks in plan.tasks_of.items()}

    def _build_all(self) -> None:
        """Build every job; a screened grid value this model cannot run (e.g. a fixed depth where the tuned readout
        has no translator) is left out of its screen, named on stderr — unless no value of its sweep can run."""
        failed: dict[str, list[str]] = {}
        for job in self.jobs:
            try:
                self._build(job)
            except ValueError as err:
                if not (job.position and job.position.screened):
                    raise
                failed.setdefault(job.position.curve, []).append(f"{job.name}: {err}")
        self.jobs = [job for job in self.jobs if job.method is not None]
        for curve, errors in failed.items():
            if not any(job.position and job.position.curve == curve for job in self.jobs):
                raise ValueError(f"no value of the screened sweep {curve!r} can run on this model: {errors[0]}")
            print(f"decode: {curve}: {len(errors)} grid values left out of the screen ({errors[0]})",
                  file=sys.stderr)

    def _build(self, job: Job) -> None:
        """Build ``job``'s method for this model and bind it (bad input fails here, before any decoding)."""
        cfg, src = self.plan.cfg, self.plan.sources
        template = src.profile.replace("{calibration}", job.calibration) if job.calibration else None
        profile_path = readout_path(template, job.point.readout)
        fitted = ESTIMATORS.get(job.point.estimator).needs_fit and src.estimators
        job.method = build_method(job.point, self.stack.n_layers, self.loaded.fingerprint.as_dict(), profile_path,
                                  readout_path(src.estimators, job.point.readout) if fitted else None,
                                  load=model_loader(cfg.device, cfg.dtype),
                                  readouts_path=src.readouts)
        job.method.bind(self.stack, self.loaded.tokenizer)  # one method for every domain and task
        job.facts = profile_facts(profile_file(profile_path, job.point.strata) if profile_path else None,
                                  job.method)

    def _add(self, extra: Sequence[Job]) -> None:
        """Build and add the jobs of ``extra`` (a screen's refinement) this decoder does not have yet."""
        have = {job.label for job in self.jobs}
        new = [Job(j.kind, j.name, j.point, j.calibration, j.position) for j in extra if j.label not in have]
        for job in new:
            self._build(job)
        self.jobs += new

    def score(self, domain: str, shard: Shard, extra: Sequence[Job] = ()) -> ShardScores:
        """The teacher-forced scores of ``shard``'s requests on ``domain`` (:mod:`emad.evaluation.shards`): of every
        job and full depth's reference — or, given ``extra`` (values a screen refines), of those jobs only — for
        :meth:`screen` to read once the shards are merged."""
        start = time.perf_counter()
        self._add(extra)
        jobs = self._of(extra)
        methods = self._methods(jobs, reference=not extra)
        shared = self._shared.setdefault(domain, Shared())
        out = score_shard(self.stack, self.loaded.tokenizer, methods, self.prepared[domain], shared,
                          self.plan.cfg.unserved_tokens, self._kept.setdefault(domain, {}), shard, self.batching)
        print(f"decode: {domain}: shard {shard} of the teacher-forced tasks of {len(jobs)} points in "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
        return out

    def screen(self, domain: str, extra: Sequence[Job] = (), scores: dict | None = None) -> list[ScreenRow]:
        """The teacher-forced tasks of every job on ``domain`` in one pass (kept for :meth:`run`) — or, given
        ``extra`` (values a screen refines), of those jobs only; the rows of the screened values it scored, from
        the scored metrics alone (no greedy generation). ``scores``: those jobs' scores (and, the first time, full
        depth's reference), merged from :meth:`score`'s shards: read, not scored again."""
        start = time.perf_counter()
        self._add(extra)
        jobs = self._of(extra)
        if scores is None:
            self._score(domain, jobs)
        else:
            self._install(domain, scores)
        rows = []
        for job in jobs:
            if job.position is None or not job.position.screened:
                continue
            result = self._forced(domain, job, 0)
            exits = hashlib.sha1(repr([o.depths for o in result.outputs]).encode()).hexdigest()[:16]
            rows.append(ScreenRow(job.name, job.position.curve, job.point.family, job.position.knob,
                                  job.position.value, job.calibration, domain, result.cost()["flops_ratio"],
                                  quality_of(result.tasks), [c.metric for c in self._ruled_out(domain, result)],
                                  exits))
        print(f"decode: {domain}: screen of {len(jobs)} points in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        return rows

    def run(self, domain: str, kept: frozenset[str] | None = None, extra: Sequence[Job] = (),
            spare: frozenset[str] = frozenset(), scores: dict | None = None, split: dict | None = None,
            labels: frozenset[str] | None = None, host: str = "") -> list[Outcome]:
        """Every job on ``domain`` (``kept``: only the jobs of those point names, and every job not screened;
        ``extra``: the refinement's jobs, which ``kept`` may name; ``spare``: the labels of screened jobs that can
        decide neither criterion on any domain, :func:`emad.evaluation.screen.costly`): its teacher-forced results
        (scored by :meth:`screen` when this decoder screened the domain, or given as ``scores``, merged from the
        shards that scored it), then its own free-running tasks, timing and heat-map inputs. ``split``: how the
        domain's work was split (recorded in each outcome's provenance). ``labels``: the jobs this call returns
        (None: every job; a group of families, :func:`emad.evaluation.shards.groups`) — full depth runs with them
        all the same, as the reference their C2 timing is decided against, and its outcome is returned only where
        ``labels`` names it."""
        cfg, stack, tokenizer, prepared = self.plan.cfg, self.stack, self.loaded.tokenizer, self.prepared[domain]
        where, start = provenance(stack.device, stack.dtype, host), time.perf_counter()
        if split is not None:
            where["split"] = split
        self._add(extra)
        if scores is not None:
            self._install(domain, scores)
        jobs = [job for job in self.jobs if kept is None or job.name in kept or not (
            job.position and job.position.screened)]
        if labels is not None:
            jobs = [job for job in jobs if job.label in labels or job.point.method == FULL]
        missing = [job for job in jobs if job.label not in self._scores.get(domain, {})]
        if missing:  # a decoder that did not screen this domain (another Ray actor did)
            self._score(domain, missing)
        self._kept.pop(domain, None)  # the screen's passes: what follows reads their scores, not their states
        shared = self._shared[domain]
        done = []  # (job, why it is not timed for C2 or None, free prompts, results)
        for job in tqdm(jobs, desc=domain, unit="point"):
            screened = self._forced(domain, job, 0)
            why = self._not_timed(job, domain, screened)
            if job.label in spare and why is not None and why.kind == Untimed.COSTLY:
                why = replace(why, spare=True)
            # a point the screen rules out decodes nothing more (but the default point where the ablations are
            # read against it); a swept one that never exits or decides neither criterion, swept_prompts; every
            # other point is judged on every prompt
            limit = (0 if why is not None and why.kind == Untimed.RULED_OUT and not self._ablation_base(job, domain)
                     else None if job.position is None or why is None else
                     cfg.swept_prompts if why.kind == Untimed.NEVER_EXITS or why.spare else None)
            forced = screened if limit == 0 else self._forced(domain, job, limit)
            free = evaluate(stack, tokenizer, job.method, [p for p in prepared if not p.task.teacher_forced], shared,
                            None, limit) if limit != 0 else Evaluation({})
            result = Evaluation({p.name: (forced.tasks | free.tasks)[p.name] for p in prepared
                                 if p.name in forced.tasks or p.name in free.tasks},
                                forced.outputs + free.outputs, forced.generated | free.generated)
            done.append((job, why, limit, result))
            release_free(min_interval=1.0)  # its generations' freed blocks lie between the kept results: give back
        timing = time.perf_counter()
        speeds = self._speeds(domain, prepared, done)
        timing = time.perf_counter() - timing
        out = []
        for job, why, limit, result in done:
            if labels is not None and job.label not in labels:
                continue
            heat = (([], None, None) if limit == 0 else
                    heatmap_inputs(stack, tokenizer, result, prepared, shared, cfg.heatmap_texts, limit))
            settings = {"tasks": {p.name: p.settings.model_dump() for p in prepared}, "free_prompts": limit,
                        "not_run": {p.name: f"the teacher-forced screen rules the point out ({why})"
                                    for p in prepared if p.name not in result.tasks},
                        "speed_repeats": cfg.speed_repeats, "speed_prompts": cfg.speed_prompts,
                        "speed_tokens": self.speed_tokens, "unserved_tokens": cfg.unserved_tokens,
                        "device": cfg.device, "dtype": cfg.dtype, "engine": stack.engine,
                        **compile_stats(stack), **result.step_facts()}
            histogram = result.depth_histogram()
            out.append(Outcome(job.label, domain, self.loaded.fingerprint.digest, stack.n_layers,
                               job.method.describe(), job.facts, result.tasks, {**result.cost(), **speeds[job.label]},
                               histogram, heat, limit, settings,
                               prove_identical(job.method, stack.n_layers, self.final_from, histogram),
                               split_record(result.tasks, cfg.split_seed), host, where))
        del self._scores[domain]
        print(f"decode: {domain}: {len(jobs)} points run in {time.perf_counter() - start:.0f} s (of which speed "
              f"{timing:.0f} s)", file=sys.stderr)
        return out

    def _ablation_base(self, job: Job, domain: str) -> bool:
        """``job`` is the point the ablations change one factor of, on a cell they run (its results are theirs to
        be read against)."""
        cfg = self.plan.cfg
        return (job.kind == "point" and job.name == cfg.default_point and domain in cfg.ablation_domains
                and job.calibration == cfg.ablation_calibration)

    def _speeds(self, domain: str, prepared: list, done: list[tuple]) -> dict[str, dict]:
        """Each job's speed-up: C2's candidates (no ``why``) timed together in one block per prompt
        (:func:`~emad.evaluation.speed.time_prompts`: one full-depth generation per prompt serves the block); the
        others the cheap measure (:meth:`_speed`). When this call runs one domain (a point's C2 interval then rests on
        this domain's prompts alone), a family whose timed point passes C2 here (every check met against full depth,
        the interval over prompts at or above ``1 + min_speed_gain``) has decided C2: its later candidates get the
        cheap measure and say so — so there the candidates are timed in rounds, each the next candidate of every
        family left in rising FLOPs order, until every family has passed or run out of candidates. Which of a
        family's candidates are timed therefore never depends on the other families of the call, nor on how a
        decode stage's run phase was split into groups of families (:func:`emad.evaluation.shards.groups`). A
        family times at most ``decode.speed_candidates`` candidates on a domain, its cheapest; the others get the
        cheap measure."""
        full = next((result for job, _, _, result in done if job.point.method == FULL), None)
        decides = len(self.plan.domains) == 1 and full is not None
        floor = 1.0 + self.plan.thresholds.min_speed_gain
        done = [(job, why or self._dear(job, result), limit, result) for job, why, limit, result in done]
        speeds = {job.label: self._speed(job, prepared, result, limit, why)
                  for job, why, limit, result in done if why is not None}
        queues: dict[str, list] = {}  # family -> its candidates (job, result, limit), in rising FLOPs order
        for job, _, limit, result in sorted((d for d in done if d[1] is None),
                                            key=lambda d: (d[0].point.family, self._judged_flops(d[3]))):
            queues.setdefault(job.point.family, []).append((job, result, limit))
        cap = self.plan.cfg.speed_candidates
        for family, queue in queues.items():
            which = f"{family}'s cheapest C2 candidate" if cap == 1 else f"among {family}'s {cap} cheapest C2 candidates"
            why = NotTimed(Untimed.SPARE, f"not {which} on {domain} (decode.speed_candidates)")
            for later, res, limit in queue[cap:] if cap is not None else []:
                speeds[later.label] = self._speed(later, prepared, res, limit, why)
            del queue[len(queue) if cap is None else cap:]
        while any(queues.values()):
            left = [queue for queue in queues.values() if queue]
            if decides:
                block = [queue.pop(0) for queue in left]
            else:  # nothing is decided on one of several domains: every candidate together
                block, queues = [c for queue in left for c in queue], {}
            for (job, result, _), speed in zip(block, self._time_block(prepared, block)):
                speeds[job.label] = speed
                if decides and self._passes_c2(domain, job, result, full, speed, floor):
                    why = NotTimed(Untimed.DECIDED, f"C2 decided for {job.point.family} by {job.label}")
                    for later, res, limit in queues.pop(job.point.family, []):
                        speeds[later.label] = self._speed(later, prepared, res, limit, why)
        return speeds

    def _judged_flops(self, result: Evaluation) -> float:
        """``result``'s FLOPs ratio on the half the verdict judges (the confirmation half of every task's units, the
        free-running ones included), as the verdict reads a point's FLOPs (:func:`emad.evaluation.judge.half_flops`);
        its ratio over every unit where a task records no per-unit cost."""
        found = half_flops({"tasks": result.tasks}, Units(CONFIRMATION, self.plan.cfg.split_seed))
        return found if found is not None else (result.cost()["flops_ratio"] or 0.0)

    def _dear(self, job: Job, result: Evaluation) -> NotTimed | None:
        """Why a point the teacher-forced screen left as a C2 candidate is not one after all: on the judged half, with
        its free-running tasks, it spends at least ``decode.speed_flops_below`` of full depth's FLOPs — the basis on
        which the verdict asks whether it does less work (a strategy is timed whatever its FLOPs)."""
        below = self.plan.cfg.speed_flops_below
        if below is None or isinstance(job.method, Strategy):
            return None
        ratio = self._judged_flops(result)
        return NotTimed(Untimed.COSTLY, f"FLOPs ratio {ratio:.3f} >= {below:g} (judged half)") if ratio >= below else None

    def _time_block(self, prepared: list, block: list[tuple]) -> list[dict]:
        """C2's timing of ``block`` (``(job, result, limit)`` each): the jobs that time the same prompts together."""
        cfg, stack, tokenizer = self.plan.cfg, self.stack, self.loaded.tokenizer
        groups: dict[tuple, list[int]] = {}  # prompts -> indices into block
        prompts = [speed_prompts_of(prepared, result, cfg.speed_prompts, cfg.split_seed) or []
                   for _, result, _ in block]
        for i, these in enumerate(prompts):
            groups.setdefault(tuple(map(tuple, these)), []).append(i)
        out: list[dict] = [{}] * len(block)
        for these, members in groups.items():
            timed = time_prompts(stack, tokenizer, [block[i][0].method for i in members], these, self.speed_tokens)
            for i, speed in zip(members, timed):
                out[i] = {**speed, "speed_timing": "pairs"}
        return out

    def _passes_c2(self, domain: str, job: Job, result: Evaluation, full: Evaluation, speed: dict,
                   floor: float) -> bool:
        """Every counted check of ``result`` against full depth on ``domain`` (selection split; identical where the
        run file's proof will say so) is met and its speed-up's interval over ≥ 8 prompts lies at or above
        ``floor``: the verdict's C2 on one domain (:func:`emad.evaluation.judge.passes_c2`)."""
        proof = prove_identical(job.method, self.stack.n_layers, self.final_from, result.depth_histogram())
        checks = checks_against(domain, result.tasks, full.tasks, self.plan.thresholds.tolerance,
                                Units(SELECTION, self.plan.cfg.split_seed), identity=proof)
        return passes_c2(checks, speed.get("speed_pairs") or [], floor)

    def _of(self, extra: Sequence[Job]) -> list[Job]:
        """The jobs of ``extra`` (a refinement), else every job."""
        labels = {job.label for job in extra}
        return [job for job in self.jobs if job.label in labels] if extra else self.jobs

    def _methods(self, jobs: list[Job], reference: bool) -> dict[str, Method | Strategy]:
        """Label → method of ``jobs``, with full depth as :data:`REFERENCE` when ``reference`` is asked for and no
        job is full depth."""
        methods = {job.label: job.method for job in jobs}
        if reference and not any(job.point.method == FULL for job in jobs):
            methods[REFERENCE] = Full()
        return methods

    def _score(self, domain: str, jobs: list[Job]) -> None:
        """The jobs' teacher-forced scores on ``domain`` in one pass (beside full depth's, the screen's reference,
        the first time); kept for :meth:`_forced`."""
        methods = self._methods(jobs, reference=domain not in self._reference)
        shared = self._shared.setdefault(domain, Shared())
        print(f"decode: {domain}: teacher-forced tasks of {len(jobs)} points", file=sys.stderr)
        self._install(domain, score_all(self.stack, self.loaded.tokenizer, methods, self.prepared[domain], shared,
                                        self.plan.cfg.unserved_tokens, self._kept.setdefault(domain, {}),
                                        self.batching))

    def _install(self, domain: str, scores: dict) -> None:
        """Keep ``scores`` (label → its teacher-forced scores) for :meth:`_forced`; the first time, full depth's
        teacher-forced results from its scores among them (a full-depth job's, else :data:`REFERENCE`'s): the
        screen's reference."""
        self._scores.setdefault(domain, {}).update(scores)
        shared = self._shared.setdefault(domain, Shared())
        if domain in self._reference:
            return
        full = next((job for job in self.jobs if job.point.method == FULL and job.label in scores), None)
        label, method = (full.label, full.method) if full else (REFERENCE, Full())
        if label not in scores:
            raise ValueError(f"{domain}: the scores given hold no full-depth reference ({REFERENCE} or a full job)")
        teacher = [p for p in self.prepared[domain] if p.task.teacher_forced]
        self._reference[domain] = evaluate(self.stack, self.loaded.tokenizer, method, teacher, shared,
                                           scores[label], 0).tasks

    def _forced(self, domain: str, job: Job, limit: int | None) -> Evaluation:
        """``job``'s teacher-forced results on ``domain`` from its scores (``limit`` 0: no greedy generation)."""
        teacher = [p for p in self.prepared[domain] if p.task.teacher_forced]
        return evaluate(self.stack, self.loaded.tokenizer, job.method, teacher, self._shared[domain],
                        self._scores[domain][job.label], limit)

    def _ruled_out(self, domain: str, forced: Evaluation) -> list:
        """The teacher-forced checks that rule ``forced`` out against full depth on ``domain``."""
        return screen(domain, forced.tasks, reference=self._reference[domain],
                      tolerance=self.plan.thresholds.tolerance, seed=self.plan.cfg.split_seed)

    def _speed(self, job: Job, prepared: list, result, limit: int | None, why: NotTimed) -> dict:
        """The speed-up of a point the verdict does not time (``why``): the cheap ``speed_repeats`` measure, or none
        when it decoded nothing free running."""
        cfg, stack, tokenizer = self.plan.cfg, self.stack, self.loaded.tokenizer
        if limit == 0:
            return {**measure_speedup(stack, tokenizer, job.method, [], 0, 0), "speed_timing": f"none: {why}"}
        timed = point_speedup(stack, tokenizer, job.method, prepared, result, limit, cfg.speed_repeats,
                              reference=self._reference_speed)
        return {**timed, "speed_timing": f"cheap: {why}"}

    def _reference_speed(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Full depth's tokens/s on ``prompts`` (:func:`~emad.evaluation.speed.reference_speed`), made once per prompt
        set and token count in this process: the cheap measure's reference."""
        key = (tuple(tuple(p) for p in prompts), new_tokens)
        if key not in self._references:
            self._references[key] = reference_speed(self.stack, self.loaded.tokenizer, prompts, new_tokens)
        return self._references[key]

    def _not_timed(self, job: Job, domain: str, forced: Evaluation) -> NotTimed | None:
        """Why the verdict cannot read this point's speed (None: it can, and is timed over prompts): full depth
        itself, an ablation (one factor of one point, on a subset of domains: the verdict does not judge it), a
        point a teacher-forced check rules out on the selection split, a point that never exits (it runs every
        layer and its probes: it cannot be faster), and a point whose teacher-forced FLOPs ratio is at least
        ``decode.speed_flops_below`` (it computes at least as much as full depth). A strategy (EAD, speculative
        decoding) trades FLOPs for fewer sequential passes: it is timed whatever its FLOPs and exit depths."""
        ruled_out = self._ruled_out(domain, forced)
        depths = set(forced.depth_histogram())
        ratio, below = forced.cost()["flops_ratio"], self.plan.cfg.speed_flops_below
        if job.point.method == FULL:
            return NotTimed(Untimed.FULL, str(Untimed.FULL))
        if job.kind == "ablation":
            return NotTimed(Untimed.ABLATION, str(Untimed.ABLATION))
        if ruled_out:
            return NotTimed(Untimed.RULED_OUT, f"violates {', '.join(c.metric for c in ruled_out)} (teacher forced, "
                            "selection split)")
        if isinstance(job.method, Strategy):
            return None
        if depths and depths <= {self.stack.n_layers}:
            return NotTimed(Untimed.NEVER_EXITS, str(Untimed.NEVER_EXITS))
        if below is not None and ratio is not None and ratio >= below:
            return NotTimed(Untimed.COSTLY, f"FLOPs ratio {ratio:.3f} >= {below:g} (teacher forced)")
        return None
