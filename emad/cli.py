"""The ``emad`` console script: a thin shell over the library (generate, score)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from emad.engine.engines import CHOICES as ENGINE_CHOICES
from emad.exits.batching import BATCH_EXITS
from emad.exits.estimators import ESTIMATORS
from emad.exits.policies import POLICIES
from emad.exits.readouts import READOUTS
from emad.exits.strata import VARIANTS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="embedded alias (e.g. smollm2-135m), local folder or hub id")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--engine", default="auto", choices=ENGINE_CHOICES,
                   help="decode engine: auto (compiled on CUDA, eager on CPU), eager, compiled")
    from emad.evaluation.operating_point import method_names

    p.add_argument("--method", default="full", choices=method_names(), help="exit criterion or strategy")
    p.add_argument("--depth", type=int, help="layers run per token for --method fixed (1..L)")
    p.add_argument("--threshold", type=float, help="entropy threshold h0 (nats) for --method confidence")
    p.add_argument("--probe-every", type=int, help="probe every k-th layer for --method confidence")
    p.add_argument("--profile", type=Path, help="profile.json for --method emad")
    p.add_argument("--strata", choices=list(VARIANTS),
                   help="stratification of --profile to use (strata/<variant>.json beside it; default: as given)")
    p.add_argument("--probe-stride", type=int, help="probe every k-th profile layer, counted down from L")
    p.add_argument("--margin", type=float, help="margin m (nats) for --method emad: exit when H <= tau - m")
    p.add_argument("--min-exit-layer", type=int, help="no exit below this layer")
    p.add_argument("--policy", default="monotone", choices=POLICIES.names(), help="KV-consistency policy")
    p.add_argument("--estimator", default="exact", choices=ESTIMATORS.names(), help="entropy estimator at probes")
    p.add_argument("--batch-exit", choices=BATCH_EXITS.names(),
                   help="when a batch step's rows leave: per-row (default) or sync (all at the first probe where "
                        "every row may exit)")
    p.add_argument("--estimators", type=Path,
                   help="fitted estimators file (default: estimators.json beside --profile; the pipeline's: "
                        "data/estimators/<model>/<readout>.json)")
    _add_readout_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt / text")
    calm = p.add_argument_group("--method softmax / contrastive, --estimator prune")
    calm.add_argument("--layer-thresholds", type=_layer_values, metavar="L=T,...",
                      help="softmax: per-layer gap thresholds overriding --threshold, e.g. 6=0.9,12=0.8")
    calm.add_argument("--alpha", type=float, help="contrastive: plausibility α in [0, 1] (default 0.1)")
    calm.add_argument("--alpha-rate", type=float, help="contrastive: r of α′ = α/(1 + r·ℓ)·(1 − confidence)")
    calm.add_argument("--distance-discount", type=float, help="contrastive: d of JSD/(1 + d·(ℓ − m))")
    calm.add_argument("--contrast-weight", type=float, help="contrastive: w of log p − w·log p_amateur (1 = DoLa)")
    calm.add_argument("--contrastive-output", action="store_true", default=None,
                      help="contrastive: read tokens from the contrastive distribution (DoLa-style)")
    calm.add_argument("--prune-k", type=int, help="prune: kept vocabulary k (k0 of the decay schedule)")
    calm.add_argument("--prune-schedule", choices=["fixed", "decay", "adaptive"], help="prune: k schedule")
    calm.add_argument("--prune-k-min", type=int, help="prune: k* of the decay schedule")
    ead = p.add_argument_group("--method ead (two-model entropy switching)")
    ead.add_argument("--tau", type=float, help="entropy threshold τ (nats) of the rolling mean")
    ead.add_argument("--small", help="the small model (spec sharing the tokenizer)")
    ead.add_argument("--small-layers", type=int, help="or: the model's own first k layers as the small model")
    ead.add_argument("--window", type=int, help="tokens in the rolling entropy mean (default 5)")
    ead.add_argument("--d-min", type=int, help="tokens a model produces before it may hand over (default 10)")
    ead.add_argument("--start", choices=["small", "large"], help="model of the first token (default small)")
    spec = p.add_argument_group("--method speculative (drafts verified by the model)")
    spec.add_argument("--drafter", help="'self' (early exit at --exit-layer) or a drafter model spec")
    spec.add_argument("--exit-layer", type=int, help="E, the self-drafter's exit layer (1..L-1)")
    spec.add_argument("--draft-policy", choices=["static", "adaedl", "confidence"], help="draft length (static)")
    spec.add_argument("--max-draft", type=int, help="N, the most drafts per round (default 4)")
    spec.add_argument("--gamma", type=float, help="AdaEDL γ (default 0.2)")
    spec.add_argument("--lam", type=float, help="AdaEDL starting λ (default 0.4)")
    spec.add_argument("--target-acceptance", type=float, help="AdaEDL target acceptance rate (default 0.7)")
    spec.add_argument("--beta", type=float, help="AdaEDL acceptance EMA factor (default 0.9)")
    spec.add_argument("--eta", type=float, help="AdaEDL λ step (default 0.1)")
    spec.add_argument("--draft-confidence", type=float, help="confidence policy: stop below this top-1 probability")


def _add_readout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--readout", choices=READOUTS.names(),
                   help="how probe layers are read out: logit (final norm + head) or tuned (trained translators)")
    p.add_argument("--readouts", type=Path, help="readouts.safetensors for --readout tuned (stage fit_readouts)")


def _layer_values(text: str) -> dict[int, float]:
    """``6=0.9,12=0.8`` → ``{6: 0.9, 12: 0.8}``."""
    try:
        return {int(k): float(v) for k, v in (pair.split("=") for pair in text.split(",") if pair)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER=THRESHOLD[,LAYER=THRESHOLD...], got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emad", description="Entropy-guided adaptive-depth decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate continuations of prompts")
    _add_model_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    gen.add_argument("--batch-file", type=Path, help="prompts, one per line (or .jsonl with a 'prompt' field)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    sc = sub.add_parser("score", help="per-token log-probabilities of a text (teacher forcing)")
    _add_model_args(sc)
    sc.add_argument("--text-file", type=Path, required=True)
    sc.set_defaults(func=cmd_score)

    cal = sub.add_parser("calibrate", help="calibrate an entropy profile (stats.json + profile.json in --out)")
    cal.add_argument("--model", required=True, help="embedded alias, local folder or hub id")
    src = cal.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", type=Path, help="sampled corpus folder (its calib.jsonl is used)")
    src.add_argument("--text-file", type=Path, action="append", help="plain text file(s), one document each")
    cal.add_argument("--out", type=Path, required=True, help="folder for stats.json and profile.json")
    _add_readout_args(cal)
    cal.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a calibrate/smooth param, e.g. --set calibrate.window=128 "
                          "--set smooth.min_count=20 (YAML values)")
    cal.set_defaults(func=cmd_calibrate)

    prof = sub.add_parser("profile", help="inspect a profile")
    prof_sub = prof.add_subparsers(dest="profile_command", required=True)
    show = prof_sub.add_parser("show", help="print τ per stratum and probe layer")
    show.add_argument("path", type=Path)
    show.set_defaults(func=cmd_profile_show)
    return parser


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.batch_file is not None:
        if not args.batch_file.is_file():
            raise ValueError(f"--batch-file {args.batch_file}: no such file")
        lines = [ln for ln in args.batch_file.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if args.batch_file.suffix == ".jsonl":
            lines = [json.loads(ln)["prompt"] for ln in lines]
        prompts += lines
    if not prompts:
        raise ValueError("give at least one --prompt or a --batch-file")
    return prompts


def _load(args):
    """Model, layer stack and method from the flags; every check happens before any decoding."""
    from emad.engine.engines import with_engine
    from emad.engine.models import load_model
    from emad.engine.stack import LayerStack
    from emad.evaluation.operating_point import PointConfig, build_method, model_loader, point_from_options

    given = {k: v for k in PointConfig.model_fields if (v := getattr(args, k, None)) is not None}
    point = point_from_options(given, "options")
    if args.profile is not None and not args.profile.is_file():
        raise ValueError(f"--profile {args.profile}: no such file")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    stack = with_engine(LayerStack(loaded.model), args.engine)
    method = build_method(point, stack.n_layers, loaded.fingerprint.as_dict(), args.profile, args.estimators,
                          model_loader(args.device, args.dtype), args.readouts)
    method.bind(stack, loaded.tokenizer)  # e.g. a strategy's second model must share this tokenizer
    return loaded, stack, method


def cmd_generate(args) -> None:
    from emad.decode import Sampling, generate

    prompts = _read_prompts(args)
    sampling = Sampling(do_sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    loaded, stack, method = _load(args)
    tok = loaded.tokenizer
    if args.chat:
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in prompts]
        ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in ids]
    else:
        ids = [tok(p)["input_ids"] for p in prompts]
    out = generate(stack, tok, ids, method, args.max_new_tokens, sampling=sampling, stop_strings=args.stop)
    for i, prompt in enumerate(prompts):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "token_ids": out.token_ids[i],
                "text": out.texts[i],
                "depths": out.depths[i],
                "cost_ratio": out.cost_ratio(i),
                "bytes_ratio": out.cost_ratio(i, "bytes"),
                "finish_reason": out.finish_reasons[i],
                "method": out.method,
                "policy_flops": out.policy_flops[i],
                "trace": [asdict(t) for t in out.traces[i]],
                "model": loaded.fingerprint.as_dict(),
            }))
        else:
            print(prompt + out.texts[i])


def cmd_score(args) -> None:
    from emad.decode import score_adaptive

    if not args.text_file.is_file():
        raise ValueError(f"--text-file {args.text_file}: no such file")
    text = args.text_file.read_text(encoding="utf-8")
    loaded, stack, method = _load(args)
    ids = loaded.tokenizer(text)["input_ids"]
    if len(ids) < 2:
        raise ValueError(f"--text-file {args.text_file} holds fewer than 2 tokens")
    scored = score_adaptive(stack, ids[:1], ids[1:], method)
    logprobs = scored.logprobs
    nll = -sum(logprobs)
    result = {
        "n_tokens": len(logprobs),
        "nll": nll,
        "perplexity": math.exp(nll / len(logprobs)),
        "cost_ratio": scored.cost_ratio,
        "method": method.describe(),
    }
    if args.json:
        result["tokens"] = loaded.tokenizer.convert_ids_to_tokens(ids[1:])
        result["logprobs"] = logprobs
        result["depths"] = scored.depths
        print(json.dumps(result))
    else:
        print(f"{result['n_tokens']} tokens  nll {nll:.3f}  perplexity {result['perplexity']:.3f}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``emad`` console script."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, KeyError, FileNotFoundError, OSError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print(f"emad {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _overrides(pairs: list[str]) -> dict[str, dict]:
    """``section.key=value`` pairs → ``{section: {key: value}}`` (values parsed as YAML)."""
    import yaml

    out: dict[str, dict] = {"calibrate": {}, "smooth": {}}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in out:
            raise ValueError(f"--set {pair!r}: expected calibrate.KEY=VALUE or smooth.KEY=VALUE")
        out[section][name] = yaml.safe_load(value)
    return out


def cmd_calibrate(args) -> None:
    from emad.calibration.calibrate import calibrate_texts, resolve_probe_layers
    from emad.calibration.config import CalibrateConfig, SmoothConfig
    from emad.calibration.profile import smooth, smooth_variants, variant_path
    from emad.config import validate_section
    from emad.corpus import read_split
    from emad.engine.models import load_model
    from emad.exits.readouts import load_readout

    sets = _overrides(args.set)
    cfg = validate_section("calibrate", sets["calibrate"], CalibrateConfig)
    smooth_cfg = validate_section("smooth", sets["smooth"], SmoothConfig)
    if args.corpus is not None:
        texts, corpus_hash = read_split(args.corpus, "calib")
    else:
        for path in args.text_file:
            if not path.is_file():
                raise ValueError(f"--text-file {path}: no such file")
        texts, corpus_hash = [p.read_text(encoding="utf-8") for p in args.text_file], ""
    loaded = load_model(args.model, device=cfg.device, dtype=cfg.dtype)
    n_layers = loaded.fingerprint.n_layers
    readout = load_readout(args.readout or "logit", args.readouts, loaded.fingerprint.as_dict(),
                           resolve_probe_layers(cfg.probe_layers, n_layers), n_layers)
    stats = calibrate_texts(loaded, texts, cfg, corpus_hash, checkpoint=args.out / "stats.json.ckpt", readout=readout)
    profile = smooth(stats, smooth_cfg.statistic, smooth_cfg.min_count, smooth_cfg.isotonic)
    stats.save(args.out / "stats.json")
    profile.save(args.out / "profile.json")
    for variant, smoothed in smooth_variants(stats, smooth_cfg.statistic, smooth_cfg.min_count,
                                             smooth_cfg.isotonic).items():
        smoothed.save(variant_path(args.out / "profile.json", variant))
    print(format_profile(profile))


def format_profile(profile) -> str:
    """A readable table: τ (raw) per stratum and probe layer, with counts, agreement and oracle depth."""
    layers = profile.probe_layers
    head = f"{'stratum':<28}" + "".join(f"{'L' + str(x):>14}" for x in layers)
    lines = [head, "-" * len(head)]
    for name in profile.strata.names():
        cells = "".join(f"{t:>6.3f} ({r:>5.2f})" for t, r in zip(profile.tau[name], profile.raw[name]))
        note = f"  <- {profile.backed_off[name]}" if name in profile.backed_off else ""
        count = int(profile.count[name][-1]) if profile.count else 0
        lines.append(f"{name[:20]:<20}{count:>8}" + cells + note)
    lines.append(f"{'argmax = final':<28}" + "".join(f"{a:>14.3f}" for a in profile.agreement))
    lines.append(f"{'oracle depth share':<28}" + "".join(f"{o:>14.3f}" for o in profile.oracle))
    worst = max(profile.monotonicity.values(), key=lambda m: m["max"], default={"max": 0.0, "total": 0.0})
    lines.append(f"tau = smoothed {profile.smoothing.get('statistic', '?')} entropy in nats (raw in brackets); "
                 f"largest raw rise between probes {worst['max']:.3f}, total {worst['total']:.3f}; "
                 f"model {profile.model.get('spec', '?')}, corpus {profile.corpus[:12] or '-'}, readout {profile.readout}")
    return "\n".join(lines)


def cmd_profile_show(args) -> None:
    from emad.calibration.profile import Profile

    print(format_profile(Profile.load(args.path)))
