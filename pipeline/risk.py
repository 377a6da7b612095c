"""Stage ``risk``: for each search of ``risk.searches`` (or the ``--search`` given), the most aggressive certified
value of one method knob (Learn then Test on held-out prompts), then an honest check of that value on fresh prompts.

Writes ``<out>/<model>--<search>--cal-<calibration>.json`` per search (read by ``aggregate``) and logs one MLflow
run each. One process serves every search: the model and the full-depth references are made once.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch

from emad import tracking
from emad.decode import generate
from emad.engine.models import load_model
from emad.engine.stack import LayerStack
from emad.evaluation.identity import point_folder
from emad.evaluation.operating_point import build_method, readout_path
from emad.evaluation.risk import control, prompt_losses
from emad.evaluation.risk_config import RiskConfig
from emad.exits.criteria import Full
from emad.io import atomic_write_json
from emad.params import load_section
from emad.stage import run_stage
from emad.tasks.registry import TASKS

FORMAT, VERSION = "emad-risk", 1


def split_prompts(cfg: RiskConfig, corpus: Path, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out and fresh prompts: disjoint, drawn by a seeded permutation of prompts spread over the eval split."""
    fidelity = TASKS.get("fidelity")()
    total = cfg.prompts + cfg.fresh_prompts
    settings = fidelity.settings({"prompts": total, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens})
    prompts = fidelity.load(settings, corpus, tokenizer)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(0)).tolist()
    return [prompts[i] for i in order[: cfg.prompts]], [prompts[i] for i in order[cfg.prompts:]]


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    cfg = load_section("risk", RiskConfig, args.params)
    names = args.search or list(cfg.searches)
    unknown = [name for name in names if name not in cfg.searches]
    if unknown:
        raise ValueError(f"unknown search {', '.join(map(repr, unknown))}; valid: {', '.join(cfg.searches) or 'none'}")
    loaded = load_model(args.model_dir, device=cfg.device, dtype=cfg.dtype)
    stack, tok = LayerStack(loaded.model), loaded.tokenizer
    fingerprint = loaded.fingerprint.as_dict()
    methods = {}  # (search, value) -> method: every one built (and checked) before any decoding
    for name in names:
        for value in cfg.searches[name].values:
            point = cfg.searches[name].point_at(value)
            methods[name, float(value)] = build_method(
                point, stack.n_layers, fingerprint,
                readout_path(args.profile, point.readout) if point.needs_profile else None,
                readouts_path=args.readouts)
    held, fresh = split_prompts(cfg, args.corpus, tok)
    reference = generate(stack, tok, held, Full(), cfg.new_tokens).token_ids
    truth = []  # full depth on the fresh prompts, made when a search first certifies a value
    for name in names:
        search = cfg.searches[name]

        def losses(value: float, name=name) -> list[float]:
            return prompt_losses(generate(stack, tok, held, methods[name, value], cfg.new_tokens).token_ids,
                                 reference, cfg.loss)

        params = {"risk": cfg.model_dump(exclude={"searches"}), "search": search.model_dump(), "model": args.model,
                  "calibration": args.calibration}
        rid = f"{args.model}--{point_folder(name, args.calibration)}"
        profile = readout_path(args.profile, search.point_at(search.values[0]).readout)
        profile_hash = hashlib.sha256(profile.read_bytes()).hexdigest()[:16] if profile.is_file() else ""
        with tracking.stage_run("risk", params, {"model_fingerprint": loaded.fingerprint.digest,
                                                 "profile_fingerprint": profile_hash, "run_id": rid},
                                run_name=tracking.run_name("risk", args.model, name, args.calibration)) as run:
            result = control(losses, search.knob, search.values, search.conservative, cfg.delta, cfg.epsilon,
                             len(held), cfg.loss)
            check = {}
            if result.chosen is not None:
                ours = generate(stack, tok, fresh, methods[name, result.chosen], cfg.new_tokens)
                truth = truth or generate(stack, tok, fresh, Full(), cfg.new_tokens).token_ids
                result.fresh_n = len(fresh)
                result.fresh_risk = sum(prompt_losses(ours.token_ids, truth, cfg.loss)) / len(fresh)
                result.fresh_holds = result.fresh_risk <= cfg.delta
                check = {"fresh_flops_ratio": ours.cost_ratio(), "fresh_mean_depth":
                         sum(map(sum, ours.depths)) / max(sum(map(len, ours.depths)), 1)}
            record = {"format": FORMAT, "version": VERSION, "name": rid, "model": args.model, "search": name,
                      "calibration": args.calibration, "domain": cfg.domain, "point": search.point,
                      "method": search.point_at(search.values[0]).method, **result.as_dict(), **check,
                      "mlflow_run_id": run.run_id}
            for i, (risk, p) in enumerate(zip(result.risks, result.p_values)):
                run.log_metrics({"risk.held_out": risk, "risk.p_value": p}, step=i)
            run.log_metrics({k: float(v) for k, v in record.items() if k in ("chosen", "fresh_risk",
                                                                              "fresh_flops_ratio") and v is not None})
            out = args.out / f"{rid}.json"
            atomic_write_json(out, record)
            run.log_artifact(out)
        print(f"risk: {rid}: {result.guarantee}" + (f"; fresh prompts: loss {result.fresh_risk:.3f} "
                                                    f"({'holds' if result.fresh_holds else 'does not hold'})"
                                                    if result.fresh_risk is not None else ""))
    return 0


if __name__ == "__main__":
    run_stage("risk", main)
