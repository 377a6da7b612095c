"""Fitting cheap entropy estimators on calibration tokens, measuring their error, and storing them beside a profile.

File format ``emad-estimators`` version 1 (JSON): ``model`` (fingerprint), ``probe_layers``, ``corpus`` (the
calibration corpus's manifest hash), ``settings`` (the estimators section), and per estimator
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
    estimator.correction = {k: tuple(v) for k, v in correction.items()}
    mae_raw["all"], mae["all"] = _overall(mae_raw), _overall(mae)  # every layer holds the same held-out tokens
    return {"correction": {str(k): v for k, v in correction.items()}, "mae_raw": mae_raw, "mae": mae}


def _overall(per_layer: dict) -> float:
    """The MAE over every layer's held-out tokens: the mean of the per-layer MAEs (equal token counts)."""
    values = [v for k, v in per_layer.items() if k != "all"]
    return sum(values) / len(values)


def grown(data: dict, names: Sequence[str], probe_layers: Sequence[int]) -> dict[str, dict]:
    """The fitted estimators ``names`` of a model grown by idle layers (:mod:`emad.engine.idle`) at
    ``probe_layers``, from its base model's estimators file ``data`` fitted on the same tokens: below the base's L
    the grown model's states are the base model's and from there on every state is the final one, bit for bit, so
    each probe below takes the base's correction and held-out errors there and each probe from the base's L on the
    base's final layer's (the shortlist is the same: the same final argmaxes).

    Raises:
        ValueError: a probe below the base's L, or an estimator, that the base file has not fitted.
    """
    n = int(data["model"]["n_layers"])
    have = [int(p) for p in data["probe_layers"]]
    missing = [p for p in probe_layers if p < n and p not in have]
    stray = [name for name in names if name not in data["estimators"]]
    if missing or stray:
        raise ValueError(f"the base estimators file lacks probes {missing} or estimators {stray} (probes {have}, "
                         f"estimators {sorted(data['estimators'])}): fit both with the same settings")
    out = {}
    for name in names:
        entry = data["estimators"][name]
        pick = {str(p): str(min(p, n)) for p in probe_layers}
        errors = {key: {p: entry[key][q] for p, q in pick.items()} for key in ("mae_raw", "mae")}
        out[name] = {"options": entry["options"], "correction": {p: entry["correction"][q] for p, q in pick.items()},
                     **{key: {**per, "all": _overall(per)} for key, per in errors.items()}}
    return out


def build(name: str, options: dict, stack: LayerStack, sample: dict) -> Estimator:
    """An unfitted estimator of ``name`` prepared from the calibration sample (e.g. topk's shortlist)."""
    return ESTIMATORS.get(name).from_sample(stack, sample, **options)


def save(path: str | Path, fitted: dict[str, dict], model: dict, probe_layers: list[int], corpus: str = "",
         settings: dict | None = None) -> None:
    """Write fitted estimators (``{name: {"options", "correction", "mae_raw", "mae"}}``) atomically, with the
    calibration corpus's manifest hash and the estimators settings they were fitted with."""
    atomic_write_json(path, {"format": FORMAT, "version": VERSION, "model": model, "probe_layers": probe_layers,
                             "corpus": corpus, "settings": settings or {}, "estimators": fitted})


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
