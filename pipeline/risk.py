"""Stage ``risk``: for each search of ``risk.searches`` (or the ``--search`` given), the most aggressive certified
value of one method knob (Learn then Test on held-out prompts), then an honest check of that value on fresh prompts.

Writes ``<out>/<model>--<search>--cal-<calibration>.json`` per search (read by ``aggregate``) and logs one MLflow
run each. Each search is a work unit of the executor (``risk.executor`` or ``$EMAD_DECODE_EXECUTOR``: ``serial``,
one process whose model and full-depth references serve every search, or ``ray``, the searches on actors); only
this process writes and logs, in search order.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from emad import tracking
from emad.evaluation.executors import EXECUTORS, executor_name
from emad.evaluation.identity import point_folder
from emad.evaluation.operating_point import readout_path
from emad.evaluation.provenance import check_mergeable, record_mix
from emad.evaluation.risk_config import RiskConfig
from emad.evaluation.risk_search import RiskPlan, RiskWorker, SearchOutcome
from emad.io import atomic_write_json
from emad.params import load_section
from emad.stage import run_stage

FORMAT, VERSION = "emad-risk", 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="append", help="a key of risk.searches; repeat for several; default: "
                        "every one")
    parser.add_argument("--model", required=True, help="model name (as in params.yaml models)")
    parser.add_argument("--model-dir", required=True, help="prepared model folder")
    parser.add_argument("--corpus", type=Path, required=True, help="the risk domain's sampled corpus folder")
    parser.add_argument("--calibration", required=True, help="calibration source of the profile")
    parser.add_argument("--profile", required=True, help="profile.json (for methods that use one); {readout} in "
                        "the path is replaced by the point's readout")
    parser.add_argument("--readouts", type=Path, help="readouts.safetensors (stage fit_readouts) for readout: tuned")
    parser.add_argument("--out", type=Path, required=True, help="folder for the result files (one per search)")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> RiskConfig:
    """The params this stage reads, checked (the whole file first): section ``risk``."""
    return load_section("risk", RiskConfig, args.params)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_params(args)
    names = args.search or list(cfg.searches)
    unknown = [name for name in names if name not in cfg.searches]
    if unknown:
        raise ValueError(f"unknown search {', '.join(map(repr, unknown))}; valid: {', '.join(cfg.searches) or 'none'}")
    run_units = EXECUTORS.get(executor_name(cfg.executor, "risk.executor"))
    plan = RiskPlan(cfg, tuple(names), args.model_dir, args.corpus, args.profile, args.readouts)
    outcomes = run_units(plan, names, cfg.workers, actor=RiskWorker)
    mix = check_mergeable([(f"{o.name} on {o.provenance.get('worker') or 'this process'}", o.provenance)
                           for o in outcomes])
    record_mix([o.provenance for o in outcomes], mix)
    for outcome in outcomes:  # only this process writes and logs, in search order
        _write(args, cfg, outcome)
    return 0


def _write(args, cfg: RiskConfig, out: SearchOutcome) -> None:
    """One search: its result file and one MLflow run."""
    search, result = cfg.searches[out.name], out.result
    params = {"risk": cfg.model_dump(exclude={"searches", "executor", "workers"}), "search": search.model_dump(),
              "model": args.model, "calibration": args.calibration}
    rid = f"{args.model}--{point_folder(out.name, args.calibration)}"
    profile = readout_path(args.profile, search.point_at(search.values[0]).readout)
    profile_hash = hashlib.sha256(profile.read_bytes()).hexdigest()[:16] if profile.is_file() else ""
    where = {f"provenance.{k}": "" if v is None else str(v) for k, v in out.provenance.items()}
    with tracking.stage_run("risk", params, {"model_fingerprint": out.model_digest,
                                             "profile_fingerprint": profile_hash, "run_id": rid, **where},
                            run_name=tracking.run_name("risk", args.model, out.name, args.calibration)) as run:
        record = {"format": FORMAT, "version": VERSION, "name": rid, "model": args.model, "search": out.name,
                  "calibration": args.calibration, "domain": cfg.domain, "point": search.point,
                  "method": search.point_at(search.values[0]).method, **result, **out.check,
                  "provenance": out.provenance, "mlflow_run_id": run.run_id}
        for i, (risk, p) in enumerate(zip(result["risks"], result["p_values"])):
            run.log_metrics({"risk.held_out": risk, "risk.p_value": p}, step=i)
        run.log_metrics({k: float(v) for k, v in record.items() if k in ("chosen", "fresh_risk",
                                                                          "fresh_flops_ratio") and v is not None})
        path = args.out / f"{rid}.json"
        atomic_write_json(path, record)
        run.log_artifact(path)
    fresh = result.get("fresh_risk")
    print(f"risk: {rid}: {result['guarantee']}" + (f"; fresh prompts: loss {fresh:.3f} "
                                                  f"({'holds' if result['fresh_holds'] else 'does not hold'})"
                                                  if fresh is not None else ""))


if __name__ == "__main__":
    run_stage("risk", main)
