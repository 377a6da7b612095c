"""Stages ``decode``, ``decode_ablation`` and ``decode_related``: every operating point of the kinds given (or the
``--point`` given) on each of their eval domains, in one process (the model is loaded once).

``decode`` runs the baselines and the points together, each point once per calibration source (``--calibration``,
default ``calibrate.sources``: the domain-shift matrix), so that one sweep pass per domain scores the teacher-forced
tasks of all of them (the readouts they share are computed once). Kinds run together must have the same domains
and tasks. The domains are those of the kinds in params (``decode.domains`` for baselines and points,
``decode.ablation_domains`` and ``decode.related_domains``, narrowed to ``ablation_tasks`` / ``related_tasks``), or
the ``--domain`` given. Per (point, calibration, domain) it writes the run file ``<out>/<run-id>.json`` (read by
``aggregate``), a depth histogram PNG and a token-depth heat map HTML in
``<artifacts>/<point>[--cal-<source>]/<domain>/``, and logs one MLflow run with the same content. Every point's
method is built and every domain's tasks are loaded before any decoding, so bad input fails first.

Per domain, the teacher-forced tasks (perplexity, agreement, cloze, choice ...) of every point are scored first,
together (:func:`emad.evaluation.evaluate.score_all`: one sweep pass serves every point it can serve exactly);
then each point runs its free-running tasks (the first ``decode.swept_prompts`` prompts for a swept point) and
times its speed-up against full depth in this process (:mod:`emad.evaluation.speed`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tqdm import tqdm

from emad import tracking
from emad.calibration.config import CalibrateConfig
from emad.engine.models import load_model
from emad.engine.stack import LayerStack
from emad.evaluation import identity
from emad.evaluation.config import DecodeConfig
from emad.evaluation.evaluate import evaluate, heatmap_inputs, prepare, score_all
from emad.evaluation.operating_point import (
    PointConfig,
    build_method,
    model_loader,
    profile_file,
    readout_path,
)
from emad.evaluation.record import RunRecord, profile_facts
from emad.evaluation.speed import point_speedup
from emad.exits.criteria import Full
from emad.exits.estimators import ESTIMATORS
from emad.io import atomic_write_text
from emad.params import load_decode, load_section
from emad.report.checks import screen
from emad.report.config import AggregateConfig
from emad.report.frontier import FULL
from emad.report.heatmap import heatmap_html
from emad.report.plots import depth_histogram_figure, save_figure
from emad.report.verdict import Thresholds
from emad.stage import run_stage
from emad.tasks.registry import Shared

KINDS = ["baseline", "point", "ablation", "related"]
STAGES = {"baseline": "decode", "point": "decode", "ablation": "decode_ablation", "related": "decode_related"}
REFERENCE = "full depth (reference)"  # scored beside the points when no full point runs with them


@dataclass
class Job:
    """One operating point with one calibration source's profile (None without a profile), ready to run."""

    kind: str
    name: str
    point: PointConfig
    calibration: str | None
    method: object = None
    facts: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Unique within a call: the point's name, with its calibration when it has one."""
        return identity.point_folder(self.name, self.calibration)


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
    parser.add_argument("--readouts", help="readouts.safetensors (stage fit_readouts) for readout: tuned; {source} "
                        "in the path is replaced by the point's calibration source, or --readout-source without one")
    parser.add_argument("--readout-source", help="the source whose readouts serve points without a calibration")
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


def _readouts(args: argparse.Namespace, calibration: str | None) -> Path | None:
    """The readouts file of a point calibrated on ``calibration`` (None: of --readout-source)."""
    if args.readouts is None or "{source}" not in args.readouts:
        return None if args.readouts is None else Path(args.readouts)
    source = calibration or args.readout_source
    if source is None:
        raise ValueError("--readouts has {source} in its path: give --readout-source for points without a "
                         "calibration")
    return Path(args.readouts.replace("{source}", source))


def _calibrations(cfg: DecodeConfig, name: str, every: list[str], given: list[str] | None) -> list[str]:
    """The calibration sources point ``name`` runs with: those given (``--calibration``), else every source for a
    point of the domain-shift matrix (``decode.shift_points``), else ``decode.ablation_calibration``."""
    return every if given or cfg.shifts(name) else [cfg.ablation_calibration]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_decode(args.params, control=args.control)
    kinds = list(dict.fromkeys(args.kind))
    selected = _selected(cfg, kinds, args.point)
    domains = _domains(cfg, kinds, args.domain)
    points = {(kind, name): cfg.point(kind, name) for kind, name in selected}
    needy = {name: point for (_, name), point in points.items() if point.needs_profile}
    if needy and args.profile is None:
        raise ValueError(f"{', '.join(needy)} ({next(iter(needy.values())).method}) need --profile")
    calibrations = args.calibration or (load_section("calibrate", CalibrateConfig, args.params).sources
                                        if needy else [])
    jobs = [Job(kind, name, point, cal) for (kind, name), point in points.items()
            for cal in (_calibrations(cfg, name, calibrations, args.calibration) if point.needs_profile else [None])]
    loaded = load_model(args.model_dir, device=cfg.device, dtype=cfg.dtype)
    stack = LayerStack(loaded.model)
    for job in jobs:  # every method checked before any decoding
        template = args.profile.replace("{calibration}", job.calibration) if job.calibration else None
        profile_path = readout_path(template, job.point.readout)
        fitted = ESTIMATORS.get(job.point.estimator).needs_fit and args.estimators
        job.method = build_method(job.point, stack.n_layers, loaded.fingerprint.as_dict(), profile_path,
                                  readout_path(args.estimators, job.point.readout) if fitted else None,
                                  load=model_loader(cfg.device, cfg.dtype),
                                  readouts_path=_readouts(args, job.calibration))
        job.method.bind(stack, loaded.tokenizer)  # one method for every domain, as for every task of a domain
        job.facts = profile_facts(profile_file(profile_path, job.point.strata) if profile_path else None,
                                  job.method)
    prepared = {d: prepare(cfg.tasks_of(kinds[0], d), cfg.tasks, args.corpora / d if args.corpora else None,
                           loaded.tokenizer) for d in domains}
    thresholds = Thresholds(**load_section("aggregate", AggregateConfig, args.params).thresholds())
    full = next((job for job in jobs if job.point.method == FULL), None)
    reference = full.label if full else REFERENCE  # full depth's teacher-forced results: the screen's reference
    methods = {job.label: job.method for job in jobs} | ({} if full else {REFERENCE: Full()})
    for domain in domains:
        shared = Shared()
        print(f"decode: {domain}: teacher-forced tasks of {len(jobs)} points", file=sys.stderr)
        scores = score_all(stack, loaded.tokenizer, methods, prepared[domain], shared, cfg.unserved_tokens)
        teacher = [p for p in prepared[domain] if p.task.teacher_forced]
        screen_of = partial(screen, domain, reference=evaluate(stack, loaded.tokenizer, methods[reference], teacher,
                                                               shared, scores[reference]).tasks,
                            tolerance=thresholds.tolerance)
        for job in tqdm(jobs, desc=domain, unit="point"):
            _run(args, cfg, loaded, stack, job, domain, prepared[domain], shared, scores.pop(job.label), screen_of)
    return 0


def _speed(cfg: DecodeConfig, stack: LayerStack, tokenizer, job: Job, prepared: list, result, limit: int | None,
           screen_of) -> dict:
    """The point's speed-up against full depth: ``speed_pairs`` timed pairs of ``speed_tokens`` new tokens (C2's
    interval), or the cheap ``speed_repeats`` measure for full depth itself, a point that never exits (it runs
    every layer and its probes: it cannot be faster) and a point a teacher-forced check rules out."""
    teacher = {p.name: result.tasks[p.name] for p in prepared if p.task.teacher_forced}
    ruled_out = screen_of(teacher)
    depths = set(result.depth_histogram())
    why = ("full depth" if job.point.method == FULL else
           f"violates {', '.join(c.metric for c in ruled_out)} (teacher forced)" if ruled_out else
           "never exits" if depths and depths <= {stack.n_layers} else None)
    if why is None:
        timed = point_speedup(stack, tokenizer, job.method, prepared, result, 1, cfg.speed_pairs, cfg.speed_tokens)
    else:
        timed = point_speedup(stack, tokenizer, job.method, prepared, result, limit, cfg.speed_repeats)
    return {**timed, "speed_timing": "pairs" if why is None else f"cheap: {why}"}


def _run(args, cfg: DecodeConfig, loaded, stack: LayerStack, job: Job, domain: str, prepared: list, shared: Shared,
         scores: dict, screen_of) -> None:
    """One (point, calibration, domain): evaluate its tasks, write the run file and artifacts, log one MLflow run."""
    method = job.method
    limit = cfg.swept_prompts if cfg.is_swept(job.name) else None
    record = RunRecord(
        run_id=identity.run_id(args.model, job.name, domain, job.calibration), model=args.model, point=job.name,
        kind=job.kind, family=job.point.family, readout=job.point.readout,
        **cfg.curve_of(job.kind, job.name).model_dump(), options=job.point.options(), calibration=job.calibration,
        domain=domain, model_fingerprint=loaded.fingerprint.digest, n_layers=stack.n_layers, free_prompts=limit,
        method=method.describe(), **job.facts)
    rid = record.run_id
    settings = {"tasks": {p.name: p.settings.model_dump() for p in prepared}, "free_prompts": limit,
                "speed_repeats": cfg.speed_repeats, "speed_pairs": cfg.speed_pairs, "speed_tokens": cfg.speed_tokens, "unserved_tokens": cfg.unserved_tokens, "device": cfg.device,
                "dtype": cfg.dtype}
    print(f"decode: {rid}: {', '.join(p.name for p in prepared)}", file=sys.stderr)
    stage = "control_decode" if args.control else STAGES[job.kind]
    with tracking.stage_run(stage, record.mlflow_params(), record.mlflow_tags(),
                            run_name=record.mlflow_run_name()) as run:
        run.log_dict(settings, "decode_settings.json")
        result = evaluate(stack, loaded.tokenizer, method, prepared, shared, scores, limit)
        hist = result.depth_histogram()
        cost = {**result.cost(), **_speed(cfg, stack, loaded.tokenizer, job, prepared, result, limit, screen_of)}
        record = record.with_results(result.tasks, cost, hist, run.run_id)
        artifacts = args.artifacts / job.label / domain
        hist_png = save_figure(depth_histogram_figure(hist, stack.n_layers, rid), artifacts / "depth.png")
        texts, prompts, full = heatmap_inputs(stack, loaded.tokenizer, result, prepared, shared, cfg.heatmap_texts,
                                              limit)
        heat = atomic_write_text(artifacts / "heatmap.html", heatmap_html(texts, stack.n_layers, rid, prompts=prompts,
                                                                          full_depth=full))
        run.log_metrics(record.mlflow_metrics())
        run.log_artifact(hist_png)
        run.log_artifact(heat)
        out = args.out / f"{rid}.json"
        record.save(out)
        run.log_artifact(out)
    quality = ", ".join(f"{k} {v:.4g}" for k, v in record.quality.items())
    speed = f"speed-up {cost['speedup']:.2f}" if cost["speedup"] else "no speed measured"
    print(f"decode: {rid}: {quality}; FLOPs ratio {cost['flops_ratio']:.3f}; {speed} -> {out}")


if __name__ == "__main__":
    run_stage("decode", main)
