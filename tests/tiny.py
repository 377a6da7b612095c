"""Tiny random-weight models, one per adapter row, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers as tf

from emad.exits.estimators import Estimate, Estimator

VOCAB = 96


def _configs() -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=256)
    return {
        "llama": lambda: tf.LlamaConfig(**common, num_key_value_heads=2),
        "qwen2": lambda: tf.Qwen2Config(**common, num_key_value_heads=2),
        "qwen3": lambda: tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16),
        "mistral": lambda: tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=6),
        "gemma3_text": lambda: tf.Gemma3TextConfig(
            **common, num_key_value_heads=2, head_dim=16, sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=30.0,
        ),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common, rotary_pct=0.5),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=256),
        "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32),
    }


ARCHITECTURES = sorted(_configs())


def tiny_model(arch: str, seed: int = 0, n_layers: int | None = None):
    """A random fp32 CPU model of ``arch``; ``n_layers`` truncates a model built with the same seed."""
    config = _configs()[arch]()
    config._attn_implementation = "sdpa"
    config.pad_token_id = 0
    config.bos_token_id = 1
    config.eos_token_id = None
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _spread_weights(model, seed)
    if n_layers is not None:
        small = config.__class__.from_dict(config.to_dict())
        small.num_hidden_layers = n_layers
        if getattr(small, "layer_types", None) is not None:
            small.layer_types = small.layer_types[:n_layers]
        if hasattr(small, "n_layer"):
            small.n_layer = n_layers
        small._attn_implementation = "sdpa"
        truncated = tf.AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
        truncated.load_state_dict(model.state_dict(), strict=False)
        model = truncated
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _spread_weights(model, seed: int) -> None:
    """Larger random weights so that readouts are peaked and differ across layers (HF init is nearly uniform)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5) * 1.5)


class TinyTokenizer:
    """Just enough tokenizer for the decode loop: ids ↔ space-separated words."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{i}" for i in ids)


class VocabTokenizer(TinyTokenizer):
    """A tiny tokenizer with a given token → id map (to tell tokenizers apart)."""

    def __init__(self, vocab: dict):
        self.vocab = vocab

    def get_vocab(self) -> dict:
        return self.vocab


def random_prompts(n: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def save_tiny_pretrained(path, tokenizer, arch: str = "llama", n_layers: int = 4, seed: int = 0, **overrides):
    """Save a tiny random model whose vocabulary fits ``tokenizer`` (plus the tokenizer) as a HF folder.

    ``overrides`` set fields of the model's config after the tiny defaults (e.g. ``max_position_embeddings``).
    """
    config = _configs()[arch]()
    config.vocab_size = len(tokenizer)
    config.num_hidden_layers = n_layers
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 32, 64, 4
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = 2
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _spread_weights(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class ScriptedEstimator(Estimator):
    """Ĥ per layer from a table, whatever the hidden state: every row's criterion agrees (an Estimator)."""

    name = "scripted"

    def __init__(self, table: dict[int, float]):
        self.table = table

    def estimate(self, stack, h, layer, rows=None):
        ent = torch.full((h.shape[0],), self.table[layer])
        return Estimate(ent, torch.full_like(ent, 0.5), None)

    def probe_cost(self, cost):
        return 0.0, 0.0


def save_tiny_profiles(model_dir, texts: list[str], path, **strata) -> None:
    """Calibrate the model in ``model_dir`` on ``texts`` (probes 1–3, windows of 32) and save the smoothed
    profile at ``path`` with every strata variant beside it (``strata/<variant>.json``), as the smooth stage does."""
    from emad.calibration.calibrate import calibrate_texts
    from emad.calibration.config import CalibrateConfig
    from emad.calibration.profile import smooth, smooth_variants, variant_path
    from emad.engine.models import load_model

    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    cfg = CalibrateConfig(window=32, probe_layers=[1, 2, 3], device="cpu", dtype="float32",
                          **({"strata": strata} if strata else {}))
    stats = calibrate_texts(loaded, texts, cfg, "toy")
    smooth(stats, min_count=1).save(path)
    for variant, profile in smooth_variants(stats, min_count=1).items():
        profile.save(variant_path(path, variant))
