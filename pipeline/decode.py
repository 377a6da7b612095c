"""Stages ``decode``, ``decode_ablation`` and ``decode_related``: every operating point of the kinds given (or the
``--point`` given) on each of their eval domains. The work is in units — each domain, or with more workers than
domains shards of it (:class:`Phases`) — run by the executor ``decode.executor`` names
(:mod:`emad.evaluation.executors`: ``serial`` in this process, the model loaded once; or ``ray``, one actor per
worker); this process alone writes every output and logs to MLflow, domain by domain in job order, after every
unit has finished — outputs are the same whichever executor ran them and however the work was split (timings
aside).

``decode`` runs the baselines and the points together, each point once per calibration source (``--calibration``,
default ``calibrate.sources``: the domain-shift matrix), so that one sweep pass per domain scores the teacher-forced
tasks of all of them (the readouts they share are computed once). Kinds run together must have the same domains
and tasks. The domains are those of the kinds in params (``decode.domains`` for baselines and points,
``decode.ablation_domains`` and ``decode.related_domains``, narrowed to ``ablation_tasks`` / ``related_tasks``), or
the ``--domain`` given. Per (point, calibration, domain) it writes the run file ``<out>/<run-id>.json`` (read by
``aggregate``), a depth histogram PNG and a token-depth heat map HTML in
``<artifacts>/<point>[--cal-<source>]/<domain>/``, and logs one MLflow run with the same content (tag ``worker``:
the process that ran its unit). Every point's method is built and every domain's tasks are loaded before any
decoding, so bad input fails first.

Per domain, the teacher-forced tasks (perplexity, agreement, cloze, choice ...) of every point are scored first,
together (:func:`emad.evaluation.evaluate.score_all`: one sweep pass serves every point it can serve exactly) —
the screen: a screened sweep (a range or ``all``) is scored there at every value of its dense grid, and the values
it keeps are chosen from those rows over every domain (:mod:`emad.evaluation.screen`; the rows are written to
``<out>/screens/<sweep>.json``). Then each kept point runs its free-running tasks (none for a swept point a
teacher-forced check rules out; the first ``decode.swept_prompts`` prompts for one that never exits) and times its
speed-up against full depth in this process (:mod:`emad.evaluation.speed`). Layer fields relative to the model's
depth (``0.7L``) and ``to: auto`` (the profile's largest τ) resolve here, for the model of ``--model-dir``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from emad import tracking
from emad.calibration.config import CalibrateConfig
from emad.calibration.profile import Profile
from emad.evaluation import identity
from emad.evaluation.checks import Thresholds
from emad.evaluation.config import DecodeConfig
from emad.evaluation.decoder import REFERENCE, Job, Outcome, Plan, Sources
from emad.evaluation.executors import EXECUTORS, Unit, executor_name
from emad.evaluation.operating_point import profile_file, readout_path
from emad.evaluation.provenance import check_mergeable, record_mix
from emad.evaluation.record import RunRecord
from emad.evaluation.screen import ROUNDS, costly, keep, refinements, screen_record
from emad.evaluation.shards import Shard, groups, merge, shards_per_domain
from emad.evaluation.sweeps import LAYER_FIELDS, SweepPosition, swept_name
from emad.io import atomic_write_json, atomic_write_text
from emad.params import load_decode, load_section
from emad.report.config import AggregateConfig
from emad.report.heatmap import heatmap_html
from emad.stage import run_stage

KINDS = ["baseline", "point", "ablation", "related"]
STAGES = {"baseline": "decode", "point": "decode", "ablation": "decode_ablation", "related": "decode_related"}
TABLES = {"baseline": "baselines", "point": "points", "related": "related"}  # an ablation varies decode.default_point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", action="append", choices=KINDS, required=True,
                        help="which table of the decode section names the points; repeat for several (they must "
                        "run the same domains and tasks)")
    parser.add_argument("--point", action="append", help="an operating point (or ablation) of those tables; repeat "
                        "for several; default: every one")
    parser.add_argument("--model", required=True, help="model name (as in params.yaml models)")
    parser.add_argument("--model-dir", required=True, help="prepared model folder")
    parser.add_argument("--domain", action="append", help="an eval domain (a key of decode.domains); repeat for "
                        "several; default: every domain of the kinds in params")
    parser.add_argument("--corpora", type=Path, help="folder of sampled corpora, one <domain>/ each (text tasks)")
    parser.add_argument("--calibration", action="append", help="a calibration source of the points' profiles; "
                        "repeat for several (each point runs with each); default: calibrate.sources")
    parser.add_argument("--profile", help="profile.json (points and ablations); {readout} and {calibration} in the "
                        "path are replaced by each point's readout and calibration source")
    parser.add_argument("--readouts", help="readouts.safetensors (stage fit_readouts) for readout: tuned (every "
                        "point and calibration source)")
    parser.add_argument("--estimators", help="estimators.json (stage fit_estimators) for points whose estimator is "
                        "fitted (topk, lowrank); {readout} in the path is replaced by the point's readout. Default: "
                        "beside each point's profile")
    parser.add_argument("--control", action="store_true", help="the positive control: the points of params "
                        "control.decode (decode with its keys replaced), logged as stage control_decode")
    parser.add_argument("--out", type=Path, required=True, help="folder for the run files (one per point x domain)")
    parser.add_argument("--artifacts", type=Path, required=True,
                        help="folder for the histograms and heat maps (a <point>/<domain>/ each)")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def _selected(cfg: DecodeConfig, kinds: list[str], chosen: list[str] | None) -> list[tuple[str, str]]:
    """(kind, name) of every point the call runs: ``chosen`` (a sweep's name stands for its points), or all."""
    out = []
    for c in chosen or [None]:
        found = []
        for kind in kinds:
            try:
                found += [(kind, name) for name in cfg.select(kind, None if c is None else [c])]
            except ValueError:
                continue
        if not found and c is not None:
            valid = ", ".join(n for kind in kinds for n in cfg.names_of(kind)) or "none"
            raise ValueError(f"--point {c!r}: not a {' or '.join(kinds)} point or sweep; valid: {valid}")
        out += [f for f in found if f not in out]
    return out


def _domains(cfg: DecodeConfig, kinds: list[str], chosen: list[str] | None) -> list[str]:
    """The domains every kind runs (kinds run together must agree on domains and tasks)."""
    domains = {kind: cfg.domains_of(kind, chosen) for kind in kinds}
    first = kinds[0]
    for kind in kinds[1:]:
        if domains[kind] != domains[first] or any(cfg.tasks_of(kind, d) != cfg.tasks_of(first, d)
                                                  for d in domains[first]):
            raise ValueError(f"--kind {first} and --kind {kind} run different domains or tasks; run them in "
                             f"separate calls")
    return domains[first]


def _calibrations(cfg: DecodeConfig, name: str, every: list[str], given: list[str] | None) -> list[str]:
    """The calibration sources point ``name`` runs with: those given (``--calibration``), else every source for a
    point of the domain-shift matrix (``decode.shift_points``), else ``decode.ablation_calibration``."""
    return every if given or cfg.shifts(name) else [cfg.ablation_calibration]


def n_layers_of(model_dir: str) -> int:
    """The depth L of the prepared model in ``model_dir`` (its config; the weights are loaded only for a spec
    without one, e.g. a GGUF file, so that a broken one is named as the loader names it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir).get_text_config().num_hidden_layers
    except (OSError, ValueError):
        from emad.engine.models import load_model

        return load_model(model_dir, device="cpu", dtype="float32").fingerprint.n_layers


def largest_tau(cfg: DecodeConfig, args: argparse.Namespace, every: list[str]) -> dict[str, float]:
    """Each screened sweep with ``to: auto`` of the kinds the call runs → the largest τ of the profiles it runs with
    (its readout and strata, every calibration source it runs with), so that one grid serves all of them. The
    other tables' sweeps are not read: a stage reads only the params its outputs depend on (dvc.yaml)."""
    out, tables = {}, {TABLES.get(kind) for kind in args.kind}
    for name, screen in cfg.screens.items():
        if screen.table not in tables:
            continue
        point = getattr(cfg, screen.table)[name]
        if not point.needs_profile or args.profile is None:
            continue
        for cal in _calibrations(cfg, name, every, args.calibration):
            path = profile_file(readout_path(args.profile.replace("{calibration}", cal), point.readout), point.strata)
            if not path.is_file():
                raise FileNotFoundError(f"decode.{screen.table}.{name}.{screen.knob}: to: auto reads the profile "
                                        f"{path}, which does not exist (run the calibrate and smooth stages)")
            tau = max(max(row) for row in Profile.load(path).tau.values())
            out[name] = max(out.get(name, tau), tau)
    return out


def plan(args: argparse.Namespace) -> Plan:
    """The call checked against params before any model is loaded: its points, calibrations and domains, with
    layers and ranges resolved for the model."""
    cfg = load_decode(args.params, control=args.control)
    every = load_section("calibrate", CalibrateConfig, args.params).sources
    auto = largest_tau(cfg, args, args.calibration or every)
    cfg = load_decode(args.params, control=args.control,
                      context={"n_layers": n_layers_of(args.model_dir), "auto": auto})
    kinds = list(dict.fromkeys(args.kind))
    selected = _selected(cfg, kinds, args.point)
    domains = _domains(cfg, kinds, args.domain)
    points = {(kind, name): cfg.point(kind, name) for kind, name in selected}
    needy = {name: point for (_, name), point in points.items() if point.needs_profile}
    if needy and args.profile is None:
        raise ValueError(f"{', '.join(needy)} ({next(iter(needy.values())).method}) need --profile")
    calibrations = args.calibration or (every if needy else [])
    jobs = [Job(kind, name, point, cal, cfg.curves.get(name)) for (kind, name), point in points.items()
            for cal in (_calibrations(cfg, name, calibrations, args.calibration) if point.needs_profile else [None])]
    sources = Sources(args.model_dir, args.corpora, args.profile, args.readouts, args.estimators)
    thresholds = Thresholds(**load_section("aggregate", AggregateConfig, args.params).thresholds())
    screens = {name: s.points for name, s in cfg.screens.items() if any(
        j.position and j.position.curve == name for j in jobs)}
    return Plan(cfg, tuple(jobs), {d: cfg.tasks_of(kinds[0], d) for d in domains}, sources, thresholds, screens)


class Phases:
    """What the decode units do, phase by phase: score each domain's teacher-forced requests in shards (as many per
    domain as fill the executor's workers, :mod:`emad.evaluation.shards`), screen each domain from its merged
    scores, score and screen the refinements a screen asks for (:func:`emad.evaluation.screen.refinements`, at
    most ``ROUNDS`` rounds), then run the kept values (:func:`emad.evaluation.screen.keep`, over every domain) with
    every score merged so far — each domain's kept jobs in as many groups of families as it has shards
    (:func:`emad.evaluation.shards.groups`) — then stop. With one shard a domain (no more workers than domains), a
    domain's screen scores it in one call, and its run reads those scores on the same worker (the unit's home).
    ``rows``: every screen row; ``extra``: the refinements' jobs; ``split``: how the work was split (each run
    file's provenance)."""

    def __init__(self, call: Plan):
        self.call, self.rows, self.extra, self.rounds, self.ran = call, [], [], 0, False
        self.shards, self.split = 1, {}
        self.scores: dict[str, dict] = {d: {} for d in call.domains}  # domain -> job label -> its merged scores
        self.scoring: tuple[Job, ...] | None = None  # the jobs whose shards are out (() every job); None: screening

    def start(self, width: int) -> list[Unit]:
        """The first phase's units for an executor running ``width`` workers at once: every domain's shards."""
        self.shards = shards_per_domain(width, len(self.call.domains))
        self.split = {"workers": width, "screen_shards_per_domain": self.shards}
        return self._score(())

    def _score(self, jobs: Sequence[Job]) -> list[Unit]:
        """The units that score ``jobs`` (() every job) on every domain: its shards, or with one shard a domain,
        its screen, which scores them itself. Shard ``k`` of a domain is at home where shard ``k`` was scored
        before (its sweep passes are kept there)."""
        if self.shards == 1:
            return [Unit("screen", d, (tuple(jobs),), home=(d, 0)) for d in self.call.domains]
        self.scoring = tuple(jobs)
        return [Unit("score", d, (Shard(k, self.shards), self.scoring), home=(d, k)) for d in self.call.domains
                for k in range(self.shards)]

    def _reference(self, domain: str) -> dict:
        """Full depth's scores on ``domain`` (the screen's reference: a full job's, else the one scored beside)."""
        full = {job.label for job in self.call.jobs if job.point.method == identity.FULL} | {REFERENCE}
        return {label: rows for label, rows in self.scores[domain].items() if label in full}

    def __call__(self, out: list) -> list[Unit] | None:
        call, target = self.call, 1.0 - self.call.thresholds.min_flops_reduction
        if self.ran:
            return None
        if self.scoring is not None:  # a round's shards, in unit order: merged per domain, then screened
            jobs, self.scoring, units = self.scoring, None, []
            for i, d in enumerate(call.domains):
                parts = out[i * self.shards:(i + 1) * self.shards]  # (worker, its shard's scores) in shard order
                workers = len({w for w, _ in parts})  # distinct workers that scored this round's shards
                self.split.setdefault("screen_workers", {}).setdefault(d, []).append(workers)
                merged = merge([scores for _, scores in parts])
                self.scores[d].update(merged)
                units.append(Unit("screen", d, (jobs, {**merged, **self._reference(d)}), home=(d, 0)))
            return units
        self.rows.extend(row for unit in out for row in unit)
        new = refinements(self.rows, target, LAYER_FIELDS) if self.rounds < ROUNDS else {}
        if new:
            self.rounds += 1
            jobs = [job for curve, values in new.items() for v in values for job in self._at(curve, v)]
            self.extra += jobs
            return self._score(jobs)
        kept = frozenset(keep(self.rows, call.screens, target))
        below = call.cfg.speed_flops_below
        spare = frozenset() if below is None else frozenset(
            identity.point_folder(point, cal) for point, cal in costly(self.rows, max(below, target)))
        self.ran = True
        if self.shards == 1:  # the worker that screened the domain runs it, from the scores it kept
            return [Unit("run", d, (kept, tuple(self.extra), spare, None, self.split), home=(d, 0))
                    for d in call.domains]
        units = []
        for d in call.domains:
            parts = groups(self._weights(d, kept), self.shards)
            self.split.setdefault("run_groups", {})[d] = len(parts)
            units += [Unit("run", d, (kept, tuple(self.extra), spare, self.scores[d], self.split, group), home=(d, k))
                      for k, group in enumerate(parts)]
        return units

    def _weights(self, domain: str, kept: frozenset[str]) -> list[tuple[str, str, float]]:
        """``(label, family, weight)`` of every job the run phase runs on ``domain`` (kept, or not screened): the
        work it is expected to take — 1 for a job that decodes every free-running prompt, less for one the
        screen rules out there (it decodes none)."""
        out = []
        for job in [*self.call.jobs, *self.extra]:
            screened = job.position is not None and job.position.screened
            if screened and job.name not in kept:
                continue
            ruled_out = any(r.point == job.name and r.calibration == job.calibration and r.domain == domain
                            and r.ruled_out for r in self.rows)
            out.append((job.label, job.point.family, 0.1 if ruled_out else 1.0))
        return out

    def _at(self, curve: str, value: float) -> list[Job]:
        """The jobs of sweep ``curve`` at a new ``value``: one per calibration source its jobs run with."""
        first = {}  # calibration -> a job of the sweep there (its point, with the knob set to value)
        for job in self.call.jobs:
            if job.position and job.position.curve == curve:
                first.setdefault(job.calibration, job)
        return [Job(j.kind, swept_name(curve, value), j.point.model_copy(update={j.position.knob: value}),
                    j.calibration, SweepPosition(curve=curve, knob=j.position.knob, value=value, screened=True))
                for j in first.values()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    call = plan(args)
    if not call.jobs or not call.domains:  # e.g. a plan without ablations or related methods: empty outputs
        args.out.mkdir(parents=True, exist_ok=True)
        args.artifacts.mkdir(parents=True, exist_ok=True)
        print(f"decode: nothing to decode for --kind {' --kind '.join(dict.fromkeys(args.kind))} (no points or no "
              f"domains of that kind in {args.params}) -> {args.out} (empty)")
        return 0
    run_units = EXECUTORS.get(executor_name(call.cfg.executor))
    phases = Phases(call)
    outcomes = run_units(call, phases.start, call.cfg.workers, then=phases)
    jobs = {job.label: job for job in [*call.jobs, *phases.extra]}
    mix = check_mergeable([(f"{unit[0].domain} on {unit[0].provenance.get('worker') or 'this process'}",
                            unit[0].provenance) for unit in outcomes if unit])
    record_mix([o.provenance for unit in outcomes for o in unit], mix)
    args.artifacts.mkdir(parents=True, exist_ok=True)  # the stage's output, empty where nothing decoded free running
    order = {(d, label): i for i, (d, label) in enumerate((d, label) for d in call.domains for label in jobs)}
    done = sorted((o for unit in outcomes for o in unit), key=lambda o: order[o.domain, o.label])
    _record_run_workers(done)
    for outcome in done:  # only this process writes and logs, domain by domain, in job order whatever the split
        _write(args, call.cfg, jobs[outcome.label], outcome)
    for curve in sorted({r.curve for r in phases.rows}):
        atomic_write_json(args.out / "screens" / f"{curve}.json",
                          screen_record(args.model, curve, [r for r in phases.rows if r.curve == curve]))
    return 0


def _record_run_workers(outcomes: list[Outcome]) -> None:
    """Where the run phase was split in groups (``run_groups`` in the split record), how many distinct workers ran
    each domain's groups (``run_workers``), in every outcome's provenance."""
    for d in {o.domain for o in outcomes if "run_groups" in o.provenance.get("split", {})}:
        mine = [o for o in outcomes if o.domain == d]
        workers = len({o.host for o in mine})
        for o in mine:
            o.provenance["split"] = {**o.provenance["split"], "run_workers": workers}


def _write(args, cfg: DecodeConfig, job: Job, out: Outcome) -> None:
    """One (point, calibration, domain): the run file, its artifacts and one MLflow run."""
    record = RunRecord(
        run_id=identity.run_id(args.model, job.name, out.domain, job.calibration), model=args.model,
        point=job.name, kind=job.kind, family=job.point.family, readout=job.point.readout,
        **(job.position or cfg.curve_of(job.kind, job.name)).model_dump(), options=job.point.options(),
        calibration=job.calibration,
        domain=out.domain, model_fingerprint=out.fingerprint, n_layers=out.n_layers, free_prompts=out.free_prompts,
        not_run=out.settings["not_run"], identity=out.identity, split=out.split,
        method=out.method, provenance=out.provenance, **out.facts)
    rid = record.run_id
    stage = "control_decode" if args.control else STAGES[job.kind]
    with tracking.stage_run(stage, record.mlflow_params(), {**record.mlflow_tags(), "worker": out.host},
                            run_name=record.mlflow_run_name()) as run:
        run.log_dict(out.settings, "decode_settings.json")
        record = record.with_results(out.tasks, out.cost, out.histogram, run.run_id)
        run.log_metrics(record.mlflow_metrics())
        if out.free_prompts != 0:  # a point the screen rules out decoded nothing free running: its histogram is
            artifacts = args.artifacts / job.label / out.domain  # the run file's, and it has no heat map
            texts, prompts, full = out.heatmap
            from emad.report.plots import depth_histogram_figure, save_figure  # matplotlib, where it draws

            run.log_artifact(save_figure(depth_histogram_figure(out.histogram, out.n_layers, rid),
                                         artifacts / "depth.png", tight=False))
            run.log_artifact(atomic_write_text(artifacts / "heatmap.html", heatmap_html(
                texts, out.n_layers, rid, prompts=prompts, full_depth=full)))
        path = args.out / f"{rid}.json"
        record.save(path)
        run.log_artifact(path)
    quality = ", ".join(f"{k} {v:.4g}" for k, v in record.quality.items())
    speed = f"speed-up {out.cost['speedup']:.2f}" if out.cost["speedup"] else "no speed measured"
    print(f"decode: {rid}: {quality}; FLOPs ratio {out.cost['flops_ratio']:.3f}; {speed} -> {path}")


if __name__ == "__main__":
    run_stage("decode", main)
