"""Random-weight models of real shapes, built from configs written here, with prompts as token ids: what a speed
check needs where no model file can be had (a GPU image without our packages, files over a transfer's limit).

Specs: ``random:<shape>`` with a shape of :data:`SHAPES` (``random:smollm2-135m``, ``random:smollm2-1.7b``,
``random:tiny``), followed by ``+idle<N>`` as any spec (``random:smollm2-135m+idle15``: the control's 45 layers;
:mod:`emad.engine.idle`). Weights are drawn under a fixed seed on the model's device (the same model every time on a
device), wider than HF's initialisation so that readouts are peaked as a trained model's are (a near-uniform
readout makes every argmax a near-tie). Text becomes token ids byte by byte (:class:`ByteTokenizer`): no
vocabulary file, no ``tokenizers`` model, no ``gguf``.
"""

from __future__ import annotations

import torch

PREFIX = "random:"
SEED = 0

_LLAMA = dict(model_type="llama", hidden_act="silu", tie_word_embeddings=True, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES: dict[str, dict] = {  # name -> LlamaConfig fields
    "smollm2-135m": dict(_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0),
    "smollm2-1.7b": dict(_LLAMA, vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=64, max_position_embeddings=8192,
                         rope_theta=130000.0),
    "tiny": dict(_LLAMA, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,  # tests
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
}


class RandomSpecError(ValueError):
    """A ``random:`` spec that names no shape of :data:`SHAPES`."""


def shape_of(spec: str) -> dict:
    """The config fields of ``random:<shape>``.

    Raises:
        RandomSpecError: naming the valid shapes.
    """
    name = spec.removeprefix(PREFIX)
    if not spec.startswith(PREFIX) or name not in SHAPES:
        raise RandomSpecError(f"model spec {spec!r}: a random-weight model is random:<shape> with a shape of "
                              f"{', '.join(SHAPES)}")
    return SHAPES[name]


class ByteTokenizer:
    """Text ↔ token ids without a vocabulary file: UTF-8 byte ``b`` is id ``b + 3``; 0, 1 and 2 are pad, BOS and
    EOS; ids from 259 on decode as ``<id>``. Enough for generation, calibration and a tokenizer fingerprint.

    Args:
        vocab_size: the model's (at least 259).
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    OFFSET = 3
    special_tokens_map = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least {256 + self.OFFSET} ids, got "
                             f"{vocab_size}")
        self.vocab_size = vocab_size

    def __call__(self, text: str, **kwargs) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str, **kwargs) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out, run = [], bytearray()
        for i in (int(t) for t in ids):
            if self.OFFSET <= i < 256 + self.OFFSET:
                run.append(i - self.OFFSET)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not (skip_special_tokens and i < self.OFFSET):
                out.append(f"<{i}>")
        return "".join(out) + run.decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        specials = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
        return {**specials, **{f"<{i}>": i for i in range(self.OFFSET, self.vocab_size)}}


@torch.no_grad()
def random_model(spec: str, device: torch.device, dtype: torch.dtype):
    """The model of ``random:<shape>`` on ``device`` in ``dtype`` (eval mode, SDPA attention) and its
    :class:`ByteTokenizer`.

    Raises:
        RandomSpecError: an unknown shape (before any work).
    """
    fields = dict(shape_of(spec))
    import transformers as tf  # on use: the spec check above needs no transformers

    config = tf.LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    with torch.device(device):
        model = tf.LlamaForCausalLM(config)
    _spread(model, device)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = ByteTokenizer.pad_token_id
    return model, ByteTokenizer(config.vocab_size)


FINAL_NORM_GAIN = 4.0  # the final norm's weight: logits of standard deviation ~6 (HF's init: ~0.5, near uniform)


def _spread(model: torch.nn.Module, device: torch.device) -> None:
    """Matrices drawn with standard deviation 1.5 / √fan_in from a seeded generator on ``device``, the final norm's
    weight :data:`FINAL_NORM_GAIN` (peaked readouts at every layer)."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    for _, p in sorted(model.named_parameters()):
        if p.dim() >= 2:
            scale = 1.5 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=generator, device=device, dtype=p.dtype) * scale)
    model.model.norm.weight.fill_(FINAL_NORM_GAIN)
