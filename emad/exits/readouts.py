"""Readouts: how a hidden state at probe layer ℓ becomes logits, ``head(final_norm(T_ℓ(h)))``.

- ``logit`` (the logit lens): T_ℓ is the identity.
- ``tuned`` (the tuned lens): T_ℓ(h) = h + A_ℓ·h + b_ℓ, one affine translator per probe layer below L, full rank
  or rank r (A = U·Vᵀ), A = 0 and b = 0 at start, fitted by KL to the final layer's distribution with the model
  frozen (:mod:`emad.calibration.readout_fit`). The final layer is never translated.

A :class:`~emad.engine.stack.LayerStack` reads out through the readout it carries
(:meth:`~emad.engine.stack.LayerStack.with_readout`), so calibration, estimators, criteria, policies and
strategies all use it; :class:`~emad.engine.cost.CostModel` charges a translation ``2 × (A's parameters)`` FLOPs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from emad.exits import registries
from emad.io import atomic_write_bytes

FORMAT = "emad-readouts/1"


class ReadoutError(ValueError):
    """A readouts file is missing, damaged, or fitted for another model or other layers."""


class Translator(nn.Module):
    """T(h) = h + A·h + b on ``[..., d]``; A is ``[d, d]`` (full rank) or U·Vᵀ with U, V ``[d, r]``.

    At construction A = 0 and b = 0, so T is the identity bit for bit (h + 0 = h). For rank r, U starts random
    and V at zero, so gradients reach V from the first step.
    """

    def __init__(self, d: int, rank: int | None = None, generator: torch.Generator | None = None):
        super().__init__()
        if rank is not None and not 1 <= rank <= d:
            raise ValueError(f"readouts.rank must be in 1..{d} (the hidden size), or null for full rank; got {rank}")
        self.d, self.rank = d, rank
        self.bias = nn.Parameter(torch.zeros(d))
        if rank is None:
            self.weight = nn.Parameter(torch.zeros(d, d))
        else:
            self.u = nn.Parameter(torch.randn(d, rank, generator=generator) / math.sqrt(d))
            self.v = nn.Parameter(torch.zeros(d, rank))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        delta = h @ self.weight.T if self.rank is None else (h @ self.v) @ self.u.T  # [..., d]
        return h + delta + self.bias

    @property
    def is_identity(self) -> bool:
        """A = 0 and b = 0 exactly: T(h) = h + 0 = h bit for bit, whatever h."""
        a = self.weight if self.rank is None else self.v
        return not bool(a.any()) and not bool(self.bias.any())

    @property
    def matmul_params(self) -> int:
        """Parameters of A's matrices (the translation costs twice this in FLOPs per token)."""
        return self.d * self.d if self.rank is None else 2 * self.d * self.rank


class Readout:
    """Base class, and the logit lens: every layer is read through the final norm and head unchanged.

    Attributes:
        layers: probe layers that have a translator (none for the logit lens).
    """

    name: ClassVar[str]
    layers: tuple[int, ...] = ()

    def translate(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """T_ℓ(h) for hidden states ``[..., d]`` after layer ``layer`` (1-based)."""
        return h

    def identity_at(self, layer: int) -> bool:
        """T_ℓ is the identity bit for bit (the logit lens: everywhere)."""
        return True

    def matmul_params(self, layer: int) -> int:
        """Matmul parameters of T_ℓ (0 where T_ℓ is the identity)."""
        return 0

    def param_bytes(self, layer: int) -> int:
        """Bytes of T_ℓ's weights (read once per translation)."""
        return 0

    def check(self, fingerprint: dict, probe_layers: Iterable[int], n_layers: int) -> None:
        """Raise :class:`ReadoutError` when this readout cannot serve these probes of this model."""

    def to(self, device: torch.device, dtype: torch.dtype) -> Readout:
        return self

    @property
    def digest(self) -> str:
        return ""

    def describe(self) -> dict:
        return {"readout": self.name}


READOUTS = registries.READOUTS  # declared there, with its names


@READOUTS.register("logit")
class LogitLens(Readout):
    """head(final_norm(h)) at every layer."""


@READOUTS.register("tuned")
class TunedLens(Readout):
    """head(final_norm(T_ℓ(h))) with a trained affine translator per probe layer below L.

    Args:
        translators: layer (1-based) → its :class:`Translator`.
        fingerprint: the model fingerprint the translators were fitted on.
        meta: what fitting recorded (corpus, tokens, epochs, ...), saved with the weights.
    """

    def __init__(self, translators: dict[int, Translator], fingerprint: dict, meta: dict | None = None):
        self.translators = {int(k): t for k, t in sorted(translators.items())}
        self.layers = tuple(self.translators)
        self.fingerprint = dict(fingerprint)
        self.meta = dict(meta or {})

    @classmethod
    def identity(cls, layers: Iterable[int], d: int, fingerprint: dict, rank: int | None = None,
                 seed: int = 0) -> TunedLens:
        """Translators at their initial value (A = 0, b = 0) at ``layers``."""
        gen = torch.Generator().manual_seed(seed)
        return cls({int(layer): Translator(d, rank, gen) for layer in layers}, fingerprint)

    @property
    def digest(self) -> str:
        """16 hex characters of the sha256 of the translators' weights (what a checkpoint is keyed on)."""
        sha = hashlib.sha256()
        for k, t in self.translators.items():
            for name, p in sorted(t.state_dict().items()):
                sha.update(f"{k}.{name}".encode())
                sha.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return sha.hexdigest()[:16]

    def modules(self) -> nn.ModuleDict:
        """The translators as one module (for optimisers and DDP), keyed by layer."""
        return nn.ModuleDict({str(k): t for k, t in self.translators.items()})

    def translate(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """T_ℓ(h); a layer without a translator (L, or one not fitted) reads out as the logit lens —
        :func:`load_readout` and :meth:`check` refuse methods that probe unfitted layers below L."""
        translator = self.translators.get(layer)
        return h if translator is None else translator(h)

    def identity_at(self, layer: int) -> bool:
        """No translator at ``layer``, or one whose A and b are exactly zero."""
        translator = self.translators.get(layer)
        return translator is None or translator.is_identity

    def matmul_params(self, layer: int) -> int:
        translator = self.translators.get(layer)
        return 0 if translator is None else translator.matmul_params

    def param_bytes(self, layer: int) -> int:
        translator = self.translators.get(layer)
        return 0 if translator is None else sum(p.numel() * p.element_size() for p in translator.parameters())

    def check(self, fingerprint: dict, probe_layers: Iterable[int], n_layers: int) -> None:
        if self.fingerprint != dict(fingerprint):
            raise ReadoutError(f"the readouts were fitted on model {_who(self.fingerprint)}, not on "
                               f"{_who(fingerprint)}: run stage fit_readouts for this model")
        missing = sorted(set(probe_layers) - set(self.layers) - {n_layers})
        if missing:
            raise ReadoutError(f"the readouts have translators at layers {list(self.layers)}, but the method probes "
                               f"layers {missing} too: fit readouts at those layers (readouts.layers) or probe "
                               f"only {list(self.layers)}")

    def to(self, device: torch.device, dtype: torch.dtype) -> TunedLens:
        moved = {k: t.to(device=device, dtype=dtype) for k, t in self.translators.items()}
        return TunedLens(moved, self.fingerprint, self.meta)

    def describe(self) -> dict:
        rank = next(iter(self.translators.values())).rank if self.translators else None
        return {"readout": self.name, "readout_layers": list(self.layers), "readout_rank": rank}

    # ---------------------------------------------------------------- files
    def save(self, path: str | Path) -> Path:
        """Write ``readouts.safetensors`` (weights + fingerprint, layers and meta in its metadata) atomically."""
        from safetensors.torch import save

        tensors = {f"{k}.{name}": p.detach().float().cpu().contiguous()
                   for k, t in self.translators.items() for name, p in t.named_parameters()}
        facts = {"format": FORMAT, "fingerprint": self.fingerprint, "layers": list(self.layers), "meta": self.meta}
        path = Path(path)  # one metadata key: safetensors writes several in a varying order, and DVC hashes bytes
        atomic_write_bytes(path, save(tensors, metadata={"emad": json.dumps(facts, sort_keys=True)}))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TunedLens:
        """Read a readouts file; damaged files, missing tensors and non-finite weights are refused by name."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        path = Path(path)
        if not path.is_file():
            raise ReadoutError(f"readouts file {path} does not exist: run stage fit_readouts (dvc repro "
                               f"fit_readouts) or `emad fit-readouts`, or pass --readouts PATH")
        raw = path.read_bytes()
        try:
            tensors = load(raw)
            facts = json.loads(_metadata(raw).get("emad", "{}"))
            if facts.get("format") != FORMAT:
                raise ValueError(f"format {facts.get('format')!r}, expected {FORMAT!r}")
            layers = [int(x) for x in facts["layers"]]
            fingerprint, extra = dict(facts["fingerprint"]), dict(facts.get("meta", {}))
        except (SafetensorError, ValueError, KeyError, TypeError) as err:
            raise ReadoutError(f"readouts file {path} is damaged or not a readouts file ({err})") from None
        translators = {}
        for layer in layers:
            parts = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(layer)}
            for name, value in parts.items():
                if not bool(torch.isfinite(value).all()):
                    raise ReadoutError(f"readouts file {path}: the translator of layer {layer} has non-finite "
                                       f"weights ({name}); refit it (lower readouts.lr)")
            if "weight" in parts:
                t = Translator(parts["weight"].shape[0])
            elif "u" in parts and "v" in parts:
                t = Translator(parts["u"].shape[0], parts["u"].shape[1])
            else:
                raise ReadoutError(f"readouts file {path}: layer {layer} has no translator weights")
            t.load_state_dict(parts)
            translators[layer] = t
        return cls(translators, fingerprint, extra)


def _metadata(raw: bytes) -> dict:
    """The ``__metadata__`` of a safetensors blob."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]).get("__metadata__", {})


def _who(fingerprint: dict) -> str:
    return f"{fingerprint.get('spec', '?')} ({fingerprint.get('model_type', '?')}, {fingerprint.get('n_layers', '?')} " \
           f"layers, d={fingerprint.get('hidden_size', '?')})"


def load_readout(name: str, path: str | Path | None, fingerprint: dict, probe_layers: Iterable[int],
                 n_layers: int) -> Readout:
    """The readout ``name`` for a model, checked against its fingerprint and the method's probe layers (a tuned
    readout is one shared instance per unchanged file in a process).

    Raises:
        ReadoutError: ``tuned`` without a readouts file, or one fitted for another model or other layers.
    """
    cls = READOUTS.get(name)
    if cls is LogitLens:
        return LogitLens()
    if path is None:
        raise ReadoutError("readout 'tuned' needs a readouts file: run stage fit_readouts (dvc repro fit_readouts) "
                           "or pass --readouts PATH (readouts=PATH in lm-eval model_args)")
    stat = Path(path).stat() if Path(path).is_file() else None
    readout = _load_tuned(str(path), stat and stat.st_mtime_ns, stat and stat.st_size)
    readout.check(fingerprint, probe_layers, n_layers)
    return readout


@functools.lru_cache(maxsize=8)
def _load_tuned(path: str, mtime_ns: int | None, size: int | None) -> TunedLens:
    """A readouts file, loaded once per process while it is unchanged: every point that reads it shares one lens
    (a sweep then reads a layer out once for all of them)."""
    return TunedLens.load(path)
