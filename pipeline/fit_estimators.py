"""Stage ``fit_estimators``: fit the cheap entropy estimators on calibration tokens, for each readout's profile.

Writes one estimators JSON per readout (shortlists, per-layer corrections, held-out MAE vs exact entropy in nats).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from emad import tracking
from emad.calibration.calibrate import cap_tokens, windows
from emad.calibration.config import EstimatorsConfig
from emad.calibration.estimator_fit import EstimatorFitError, build, collect, fit, grown, save
from emad.calibration.profile import Profile
from emad.corpus import read_split
from emad.engine.idle import check_grown
from emad.engine.models import load_model, prepared_spec
from emad.engine.stack import LayerStack
from emad.exits.readouts import load_readout
from emad.io import read_json
from emad.params import load_section
from emad.stage import READOUT, per_readout, run_stage


def _check_sizes(cfg: EstimatorsConfig, stack: LayerStack, model_dir: str) -> None:
    """K and r fit the model, before any fitting: K ≤ the vocabulary, r ≤ the hidden size."""
    if cfg.topk is not None and cfg.topk.k > stack.vocab_size:
        raise ValueError(f"estimators.topk.k = {cfg.topk.k} exceeds the vocabulary size of {model_dir}; valid: "
                         f"1..{stack.vocab_size}")
    hidden = stack.head.weight.shape[1]
    if cfg.lowrank is not None and cfg.lowrank.rank > hidden:
        raise ValueError(f"estimators.lowrank.rank = {cfg.lowrank.rank} exceeds the hidden size of {model_dir}; "
                         f"valid: 1..{hidden}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="sampled corpus folder (calib.jsonl)")
    parser.add_argument("--profile", required=True, help=f"profile.json (its probe layers are fitted); with several "
                        f"readouts a path with {READOUT}, as --out")
    parser.add_argument("--readouts", type=Path, help="readouts.safetensors, for a profile calibrated through "
                        "the tuned readout (estimators are fitted through the profile's readout)")
    parser.add_argument("--out", required=True, help="estimators JSON to write")
    parser.add_argument("--readout", action="append", help="a readout whose profile to fit for; repeat for "
                        "several (default: every one of estimators.readouts)")
    parser.add_argument("--only", action="append", help="fit only this estimator of the estimators section "
                        "(repeat for several; default: every one)")
    parser.add_argument("--grown-from", help=f"for a model grown by idle layers (<base>+idle<N>): its base model's "
                        f"estimators fitted on the same corpus (a path with {READOUT}, as --out), extended instead of "
                        f"fitting anew")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> EstimatorsConfig:
    """The params this stage reads, checked (the whole file first): section ``estimators``."""
    return load_section("estimators", EstimatorsConfig, args.params)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_params(args)
    chosen = cfg.fitted()
    stray = [name for name in args.only or [] if name not in chosen]
    if stray:
        raise ValueError(f"--only {', '.join(stray)}: not fitted by the estimators section; valid: "
                         f"{', '.join(chosen) or 'none'}")
    chosen = {k: v for k, v in chosen.items() if not args.only or k in args.only}
    readouts = args.readout or cfg.readouts
    paths = per_readout(args.profile, readouts, "--profile")
    profiles = {name: Profile.load(path) for name, path in paths.items()}
    outs = per_readout(args.out, readouts, "--out")
    texts, corpus_hash = read_split(args.corpus, "calib")
    loaded = load_model(args.model_dir)
    base = LayerStack(loaded.model)
    _check_sizes(cfg, base, args.model_dir)
    stacks = {}
    for name, profile in profiles.items():  # every profile and readout checked before any fitting
        profile.check_model(loaded.fingerprint.as_dict())
        stacks[name] = base.with_readout(load_readout(profile.readout, args.readouts, loaded.fingerprint.as_dict(),
                                                      profile.probe_layers, base.n_layers))
    bases = {}  # readout -> the base model's estimators file, checked before any work
    for name, path in per_readout(args.grown_from, list(outs), "--grown-from").items() if args.grown_from else ():
        bases[name] = _base_file(path, prepared_spec(args.model_dir), loaded.fingerprint.as_dict(), corpus_hash,
                                 cfg, list(chosen), profiles[name].probe_layers)
    docs = [loaded.tokenizer(t)["input_ids"] for t in texts]
    for name, profile in profiles.items():
        fitted = (grown(bases[name], list(chosen), profile.probe_layers) if name in bases else
                  _fitted(cfg, chosen, stacks[name], cap_tokens(windows(docs, cfg.window), cfg.tokens), profile))
        _write(cfg, fitted, profile, paths[name], outs[name], loaded, corpus_hash, args.grown_from)
    return 0


def _base_file(path: Path, spec: str, fingerprint: dict, corpus_hash: str, cfg: EstimatorsConfig,
               names: list[str], probes: list[int]) -> dict:
    """The base model's estimators file at ``path``, checked to be this model's base on this corpus and settings."""
    data = read_json(path, "estimators file", EstimatorFitError)
    check_grown(spec, fingerprint, data.get("model", {}))
    if data.get("corpus") != corpus_hash or data.get("settings") != cfg.model_dump():
        raise ValueError(f"--grown-from {path}: fitted on another corpus or with other estimators settings than "
                         f"this corpus ({corpus_hash}) and params estimators: rerun it")
    grown(data, names, probes)  # the probes and estimators are there
    return data


def _fitted(cfg: EstimatorsConfig, chosen: dict, stack: LayerStack, token_windows: list, profile: Profile) -> dict:
    """The estimators of one profile's readout, fitted on ``token_windows``."""
    sample = collect(stack, token_windows, profile.probe_layers)
    fitted = {}
    for name, options in chosen.items():
        estimator = build(name, options, stack, sample)
        report = fit(stack, estimator, sample, cfg.holdout)
        fitted[name] = {"options": estimator.options(), **report}
    return fitted


def _write(cfg: EstimatorsConfig, fitted: dict, profile: Profile, profile_path: Path, out: Path, loaded,
           corpus_hash: str, grown_from: str | None = None) -> None:
    """One profile's fitted estimators, written to ``out``, and its MLflow run (``grown_from``: the base model's
    file template they were extended from)."""
    params = {"estimators": cfg.model_dump(), "profile": str(profile_path), "grown_from": grown_from}
    name = tracking.run_name("fit_estimators", *tracking.profile_qualifiers(profile_path, profile.readout))
    with tracking.stage_run("fit_estimators", params, {"model_fingerprint": loaded.fingerprint.digest,
                                                      "corpus_manifest": corpus_hash}, run_name=name) as run:
        save(out, fitted, loaded.fingerprint.as_dict(), profile.probe_layers, corpus_hash, cfg.model_dump())
        for name, entry in fitted.items():
            run.log_metrics({f"{name}.mae_raw": entry["mae_raw"]["all"], f"{name}.mae": entry["mae"]["all"]})
            run.log_series(f"{name}.mae_by_layer", {int(k): v for k, v in entry["mae"].items() if k != "all"})
    for name, entry in fitted.items():
        print(f"fit_estimators: {name} held-out MAE {entry['mae']['all']:.3f} nats "
              f"(uncorrected {entry['mae_raw']['all']:.3f}) -> {out}")


if __name__ == "__main__":
    run_stage("fit_estimators", main)
