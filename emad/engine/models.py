"""Resolve a model spec (local folder, embedded alias, hub id) to a loaded model, tokenizer and fingerprint."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from emad.engine.embedded import (  # noqa: F401  (re-exported: the model table's home is torch-free)
    EMBEDDED,
    SOURCE_FILE,
    EmbeddedModel,
    model_cache_dir,
    source_alias,
)
from emad.engine.fingerprint import ModelFingerprint, tokenizer_sha256  # noqa: F401  (re-exported)
from emad.engine.idle import append_idle_layers, parse_idle_spec
from emad.engine.random_models import PREFIX as RANDOM_PREFIX
from emad.engine.random_models import random_model

if TYPE_CHECKING:  # importing these eagerly costs ~1 s of transformers' lazy imports
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_QUANT_ATTRS = ("hf_quantizer", "quantization_config", "is_quantized", "quantization_method")


class ModelSpecError(ValueError):
    """A model spec that names no embedded alias, local folder or reachable hub model."""


class ModelLoadError(ValueError):
    """A model that was found but could not be loaded (a missing package, a corrupt file)."""


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, on `device`, in `dtype`) with its tokenizer and fingerprint."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: ModelFingerprint
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str = "auto") -> torch.device:
    """Turns "auto" (cuda if available, else cpu) or a torch device string into a torch.device.

    Raises:
        ValueError: `device` is not a device string, or names CUDA on a machine without it.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='auto' or 'cpu'")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Turns "auto" (float32 on CPU, bfloat16 on CUDA) or a dtype name into a torch.dtype.

    Raises:
        ValueError: `dtype` is not "auto" or one of DTYPES.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, DTYPES))}; got {dtype!r}")
    return DTYPES[dtype]


def fingerprint(spec: str, model: Any, tokenizer: Any) -> ModelFingerprint:
    """Returns the fingerprint of a loaded model under the name `spec`."""
    config = model.config.get_text_config()
    return ModelFingerprint(
        spec=spec,
        model_type=config.model_type,
        n_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
    )


def load_model(spec: str, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Loads a model by spec: a local folder with config.json, an embedded alias, or a hub id.

    An embedded alias is converted to safetensors under model_cache_dir() on first use.

    Args:
        spec: folder path, a ``.gguf`` file, a key of EMBEDDED (e.g. "smollm2-135m"), a hub id ("org/name"), or a
            random-weight model of a known shape (``random:smollm2-135m``, :mod:`emad.engine.random_models`: no
            file, its tokenizer bytes); any of them followed by ``+idle<N>`` appends N idle layers
            (:mod:`emad.engine.idle`).
        device: "auto" (cuda if available, else cpu) or a torch device string.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16" or "float16".

    Returns:
        The model in eval mode on `device` with SDPA attention, its tokenizer and fingerprint.

    Raises:
        ValueError: bad `device` or `dtype`.
        ModelSpecError: the spec resolves to nothing loadable.
        ModelLoadError: the embedded package is missing, or a model file is corrupt (the message names it).
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    idle = parse_idle_spec(spec)
    if idle is not None:  # the base model with idle layers appended (emad.engine.idle)
        base = load_model(idle[0], device=device, dtype=dtype)
        model = append_idle_layers(base.model, idle[1])
        return LoadedModel(model, base.tokenizer, fingerprint(spec, model, base.tokenizer), dev, torch_dtype)
    if spec.startswith(RANDOM_PREFIX):
        model, tokenizer = random_model(spec, dev, torch_dtype)
        return LoadedModel(model, tokenizer, fingerprint(spec, model, tokenizer), dev, torch_dtype)
    folder = Path(spec).expanduser()
    if spec in EMBEDDED:
        source, name = convert_embedded(spec, model_cache_dir() / spec), spec
    elif folder.is_file() and folder.suffix == ".gguf":
        source, name = folder, folder.stem
    elif folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelSpecError(f"model folder {str(folder)!r} has no config.json")
        source, name = folder, source_alias(folder) or folder.resolve().name
    elif _HUB_ID.match(spec) and not folder.exists():
        source, name = spec, spec
        try:
            AutoConfig.from_pretrained(spec)
        except OSError as err:
            raise ModelSpecError(_unknown_spec_message(spec, err)) from err
    else:
        raise ModelSpecError(_unknown_spec_message(spec, None))
    model, tokenizer = _from_pretrained(source, torch_dtype)
    model.to(dev).eval()
    if dev.type == "cpu":
        _off_the_file(model)
    return LoadedModel(model, tokenizer, fingerprint(name, model, tokenizer), dev, torch_dtype)


def _off_the_file(model: torch.nn.Module) -> None:
    """Copies every weight into memory of its own (64-byte aligned), out of the file it may be mapped from.

    A weight mapped from a safetensors file sits where its offset in the file puts it, and some CPUs round a float32
    matrix-vector product by the weight's alignment: the same weights in two files (a model and its +idle control,
    a re-saved copy) would give different last bits. A tied weight is one Parameter, copied once: it stays tied.
    """
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()


def convert_embedded(alias: str, out_dir: str | Path) -> Path:
    """Converts an embedded GGUF model to a safetensors folder (float32), unless out_dir already holds it.

    The folder is built in a temporary directory beside out_dir and renamed into place, so out_dir is
    either absent or complete. It holds the model, the tokenizer and SOURCE_FILE ({alias, hub_id, gguf,
    gguf_sha256}), which load_model reads to fingerprint the folder under the alias.

    Raises:
        ModelSpecError: `alias` is not a key of EMBEDDED.
        ModelLoadError: the package that ships the GGUF is not installed (the message says how to install it).
    """
    if alias not in EMBEDDED:
        raise ModelSpecError(f"unknown embedded model {alias!r}; embedded models: {', '.join(EMBEDDED)}")
    entry, out = EMBEDDED[alias], Path(out_dir)
    if source_alias(out) == alias:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # processes converting into one folder at once (test workers, parallel stages): the first converts, the
    # others wait and find it complete, so none removes a folder another is reading
    with FileLock(out.parent / f".{out.name}.lock"):
        if source_alias(out) == alias:
            return out
        return _convert(alias, entry, out)


def _convert(alias: str, entry: EmbeddedModel, out: Path) -> Path:
    """:func:`convert_embedded`'s conversion into ``out`` (its caller holds the folder's lock)."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        gguf = _gguf_path(alias, entry, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        for obj in (model, model.config):  # weights are dequantized: drop the GGUF quantizer so it saves plain
            for attr in _QUANT_ATTRS:
                if attr in vars(obj):
                    delattr(obj, attr)
        staging = Path(tmp) / "model"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        source = {"alias": alias, "hub_id": entry.hub_id, "gguf": entry.gguf, "gguf_sha256": _sha256_file(gguf)}
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)  # an incomplete or foreign folder
        os.replace(staging, out)
    return out


def prepare_model(spec: str, out_dir: str | Path) -> Path:
    """A self-contained safetensors folder for any model spec: embedded aliases are converted
    (:func:`convert_embedded`); a local folder or hub id is loaded (float32) and saved, atomically, with its spec
    recorded in SOURCE_FILE."""
    if spec in EMBEDDED:
        return convert_embedded(spec, out_dir)
    out = Path(out_dir)
    loaded = load_model(spec, device="cpu", dtype="float32")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        staging = Path(tmp) / "model"
        loaded.model.save_pretrained(staging, safe_serialization=True)
        loaded.tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(json.dumps({"spec": spec}, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    return out


def _gguf_path(alias: str, entry: EmbeddedModel, workdir: Path) -> Path:
    """Returns the GGUF file of `entry`, assembling a chunked one into `workdir`."""
    if not entry.chunks:
        return _package_dir(alias, entry, entry.package) / entry.gguf
    target = workdir / entry.gguf
    with target.open("wb") as dst:
        for chunk in entry.chunks:
            module, rel = chunk.split(":", 1)
            with (_package_dir(alias, entry, module) / rel).open("rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    return target


def _package_dir(alias: str, entry: EmbeddedModel, module: str) -> Path:
    spec = importlib.util.find_spec(module)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"embedded model {alias!r} needs package {module!r}: {entry.install}")
    return Path(spec.submodule_search_locations[0])


def prepared_spec(model_dir: str | Path) -> str:
    """The spec a prepared model folder was made from (its SOURCE_FILE: ``spec``, or the embedded ``alias``); the
    folder's path when it records none (or ``model_dir`` is not a folder)."""
    try:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
        return str(source.get("spec") or source["alias"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return str(model_dir)


def _from_pretrained(source: str | Path, torch_dtype: torch.dtype) -> tuple[Any, Any]:
    """Loads config, tokenizer and model; a failure becomes a ModelLoadError naming the bad file."""
    where = Path(source)
    if where.suffix == ".gguf" and where.is_file():  # a single GGUF file: transformers dequantizes it
        gguf = {"gguf_file": where.name}
        tokenizer = _load_or_name(lambda: where, AutoTokenizer.from_pretrained, where.parent, **gguf)
        model = _load_or_name(lambda: where, AutoModelForCausalLM.from_pretrained, where.parent, **gguf,
                              dtype=torch_dtype, attn_implementation="sdpa")
        return model, tokenizer
    config = _load_or_name(lambda: where / "config.json", AutoConfig.from_pretrained, source)
    tokenizer = _load_or_name(lambda: where / "tokenizer.json", AutoTokenizer.from_pretrained, source)
    model = _load_or_name(
        lambda: _bad_weight_file(where) or where,
        AutoModelForCausalLM.from_pretrained,
        source, config=config, dtype=torch_dtype, attn_implementation="sdpa",
    )
    return model, tokenizer


def _load_or_name(culprit: Callable[[], Path], load: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Returns load(*args, **kwargs); on failure raises ModelLoadError naming culprit() and the error."""
    try:
        return load(*args, **kwargs)
    except Exception as err:
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"cannot load {culprit()}: {type(err).__name__}: {first_line}") from err


def _bad_weight_file(folder: Path) -> Path | None:
    """Returns the first safetensors file in `folder` that does not read back in full, if any."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        except Exception:
            return path
    return None


def _unknown_spec_message(spec: str, err: OSError | None) -> str:
    reason = f"hub load failed ({type(err).__name__})" if err is not None else "not a hub id"
    if err is not None and os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        reason = "hub is offline (HF_HUB_OFFLINE is set)"
    return (
        f"unknown model spec {spec!r}: not an embedded alias, not a local folder, {reason}; "
        f"embedded aliases: {', '.join(EMBEDDED)}; a local folder path with config.json also works, and so does "
        f"random:<shape> (random weights)"
    )


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
