"""Fitting cheap entropy estimators on calibration tokens, measuring their error, and storing them beside a profile.

File format ``emad-estimators`` version 1 (JSON): ``model`` (fingerprint), ``probe_layers``, and per estimator
name its constructor options (``k`` + ``shortlist`` / ``rank``), ``correction`` ``{layer: [slope, intercept]}``
and held-out errors ``mae_raw`` / ``mae`` (nats, per layer and overall).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from emad.engine.entropy import readout_summary
from emad.engine.stack import LayerStack
from emad.exits.estimators import ESTIMATORS, Estimator
from emad.io import atomic_write_json, read_json

FORMAT, VERSION = "emad-estimators", 1


class EstimatorFitError(ValueError):
    """An estimator file is missing, damaged, or fitted for another model / probe set."""


@torch.inference_mode()
def collect(stack: LayerStack, token_windows: Sequence[Sequence[int]], probe_layers: list[int]) -> dict:
    """Hidden states and exact entropies at each probe for every token of the windows (teacher forcing).

    Returns:
        ``{"hidden": {layer: [N, d]}, "entropy": {layer: [N]}, "final_argmax": [N], "inputs": [N]}``.
    """
    hidden = {p: [] for p in probe_layers}
    entropy = {p: [] for p in probe_layers}
    final, inputs = [], []
    for w in token_windows:
        ids = torch.tensor([list(w)], device=stack.device)
        pos = torch.arange(len(w), device=stack.device)[None]
        cache = stack.new_cache(1, len(w))
        slots = cache.allocate(torch.ones_like(ids, dtype=torch.bool))
        h, done, prev = stack.embed(ids, pos), 0, None
        for p in probe_layers:
            h = stack.run(h, done, p, cache, pos, slots)
            done = p
            moved = stack.translate(h[0], p)  # a probe whose state translates as the previous one's reads out alike
            if prev is None or not torch.equal(moved, prev[0]):
                prev = moved, readout_summary(stack.readout(h[0], p))
            ent, argmax, _ = prev[1]
            hidden[p].append(h[0])
            entropy[p].append(ent)
        final.append(argmax)
        inputs.append(ids[0])
    return {"hidden": {p: torch.cat(v) for p, v in hidden.items()},
            "entropy": {p: torch.cat(v) for p, v in entropy.items()},
            "final_argmax": torch.cat(final), "inputs": torch.cat(inputs)}


@torch.inference_mode()
def fit(stack: LayerStack, estimator: Estimator, sample: dict, holdout: float = 0.2) -> dict:
    """Fit ``estimator``'s per-layer linear correction on the first tokens of ``sample``; report held-out MAE.

    Returns:
        ``{"correction": {layer: [slope, intercept]}, "mae_raw": {...}, "mae": {...}}`` (MAE in nats, per layer
        and ``"all"``).
    """
    n = next(iter(sample["entropy"].values())).shape[0]
    cut = max(1, int(n * (1 - holdout)))
    estimator.correction = {}
    correction, mae_raw, mae = {}, {}, {}
    raw_all, fit_all, exact_all = [], [], []
    for layer, h in sample["hidden"].items():
        exact = sample["entropy"][layer].double()
        raw = estimator.estimate(stack, h, layer).entropy.double()
        x, y = raw[:cut], exact[:cut]
        design = torch.stack([x, torch.ones_like(x)], 1)
        slope, intercept = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
        correction[layer] = [slope, intercept]
        fitted = (raw[cut:] * slope + intercept).clamp_min(0.0)
        mae_raw[layer] = float((raw[cut:] - exact[cut:]).abs().mean())
        mae[layer] = float((fitted - exact[cut:]).abs().mean())
        raw_all.append(raw[cut:])
        fit_all.append(fitted)
        exact_all.append(exact[cut:])
    estimator.correction = {k: tuple(v) for k, v in correction.items()}
    exact_cat = torch.cat(exact_all)
    mae_raw["all"] = float((torch.cat(raw_all) - exact_cat).abs().mean())
    mae["all"] = float((torch.cat(fit_all) - exact_cat).abs().mean())
    return {"correction": {str(k): v for k, v in correction.items()}, "mae_raw": mae_raw, "mae": mae}


def build(name: str, options: dict, stack: LayerStack, sample: dict) -> Estimator:
    """An unfitted estimator of ``name`` prepared from the calibration sample (e.g. topk's shortlist)."""
    return ESTIMATORS.get(name).from_sample(stack, sample, **options)


def save(path: str | Path, fitted: dict[str, dict], model: dict, probe_layers: list[int]) -> None:
    """Write fitted estimators (``{name: {"options", "correction", "mae_raw", "mae"}}``) atomically."""
    atomic_write_json(path, {"format": FORMAT, "version": VERSION, "model": model, "probe_layers": probe_layers,
                             "estimators": fitted})


def load(path: str | Path, name: str, model: dict | None = None, probe_layers: list[int] | None = None
         ) -> Estimator:
    """The fitted estimator ``name`` from ``path``; refuses another model or probe set, or an unfitted name."""
    if name == "exact":
        return ESTIMATORS.get("exact")()
    data = read_json(path, "estimator file", EstimatorFitError)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise EstimatorFitError(f"{path} is not an {FORMAT} v{VERSION} file")
    if name not in data.get("estimators", {}):
        raise EstimatorFitError(f"estimator {name!r} was not fitted in {path}; fitted: "
                                f"{', '.join(sorted(data.get('estimators', {}))) or 'none'}")
    keys = ("model_type", "n_layers", "hidden_size", "vocab_size", "tokenizer_sha256")
    if model is not None and {k: data["model"].get(k) for k in keys} != {k: model.get(k) for k in keys}:
        raise EstimatorFitError(f"{path} was fitted for model {data['model']}, not {model}")
    if probe_layers is not None and not set(probe_layers) <= set(data["probe_layers"]):
        raise EstimatorFitError(f"{path} was fitted at probes {data['probe_layers']}, the method probes "
                                f"{probe_layers}")
    entry = data["estimators"][name]
    return ESTIMATORS.get(name)(**entry["options"], correction=entry["correction"])
