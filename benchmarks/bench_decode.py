"""Full-depth decode speed of the layer stack vs HF ``generate`` (same model, prompts, tokens; alternated).

Also times one decoder layer and one readout at a decode step, so probe costs can be set against layer costs.
Writes reports/bench/decode[-<device>-<dtype>].json.

Usage: python benchmarks/bench_decode.py [--model smollm2-135m] [--device auto] [--dtype auto] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, environment, timed, write  # noqa: E402

from emad.decode import generate, left_pad, positions_of  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Full  # noqa: E402

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Shall I compare thee to a summer's day? Thou art more lovely",
    "A train leaves the station at 3 pm travelling at 60 miles per hour. How far",
    "The mitochondria is the powerhouse of the cell, and",
    "In 1969, astronauts landed on the Moon for the first time. The mission",
    "import os\nimport sys\n\ndef main():\n",
    "Once upon a time, in a small village by the sea,",
]


def hf_generate(model, ids: torch.Tensor, real: torch.Tensor, new: int, pad_id: int):
    return model.generate(ids, attention_mask=real.long(), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad_id)


def _until(ids: list[int], eos: int) -> list[int]:
    """Tokens before the first EOS: HF's min_new_tokens bans EOS while ours emits it, so only that prefix is shared."""
    return ids[: ids.index(eos)] if eos in ids else ids


def bench_generate(loaded, stack, batch: int, new: int, reps: int) -> dict:
    tok = loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in (PROMPTS * batch)[:batch]]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, real = left_pad(prompts, pad, stack.device)
    ours = lambda: generate(stack, tok, prompts, Full(), new, eos_token_ids=[])  # noqa: E731
    theirs = lambda: hf_generate(loaded.model, ids, real, new, pad)  # noqa: E731
    eos = tok.eos_token_id
    hf_rows = hf_generate(loaded.model, ids, real, new, pad)[:, ids.shape[1]:].tolist()
    same = all(a[:n] == b[:n] for a, b in zip(ours().token_ids, hf_rows) for n in [len(_until(a, eos))])
    t = alternate({"emad": ours, "hf": theirs}, reps, stack.device)
    return {
        "batch": batch,
        "new_tokens": new,
        "emad_s": t["emad"],
        "hf_s": t["hf"],
        "emad_tokens_per_s": batch * new / t["emad"],
        "hf_tokens_per_s": batch * new / t["hf"],
        "time_ratio_emad_over_hf": t["emad"] / t["hf"],
        "identical_tokens_until_eos": same,
    }


@torch.inference_mode()
def bench_layer_and_readout(stack: LayerStack, context: int, reps: int) -> dict:
    """Median time of one layer and of one readout for one token at a decode step with ``context`` keys."""
    real = torch.ones(1, context, dtype=torch.bool, device=stack.device)
    ids = torch.randint(0, stack.vocab_size, (1, context), device=stack.device)
    cache = stack.new_cache(1, context + reps + 8)
    pos = positions_of(real)
    slots = cache.allocate(real)
    stack.run(stack.embed(ids, pos), 0, stack.n_layers, cache, pos, slots)
    h = stack.embed(ids[:, :1], pos[:, -1:] + 1)
    layer_times, readout_times = [], []
    middle = stack.n_layers // 2
    for _ in range(reps):
        slots = cache.allocate(torch.ones(1, 1, dtype=torch.bool, device=stack.device))
        layer_times.append(timed(lambda s=slots: stack.run(h, middle, middle + 1, cache, pos[:, -1:] + 1, s),
                                 stack.device))
        readout_times.append(timed(lambda: stack.readout(h[:, -1]), stack.device))
    layer_times.sort()
    readout_times.sort()
    layer, readout = layer_times[len(layer_times) // 2], readout_times[len(readout_times) // 2]
    return {"context": context, "layer_s": layer, "readout_s": readout, "readout_over_layer": readout / layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    stack = LayerStack(loaded.model)
    result = {
        "benchmark": "full-depth decode vs HF generate",
        "model": loaded.fingerprint.as_dict(),
        "environment": environment(stack.device, stack.dtype),
        "generate": [bench_generate(loaded, stack, b, args.new_tokens, args.reps) for b in (1, 8)],
        "layer_vs_readout": bench_layer_and_readout(stack, context=128, reps=50),
    }
    suffix = "" if stack.device.type == "cpu" else f"-{stack.device.type}-{result['environment']['dtype']}"
    path = write("decode" + suffix, result)
    for g in result["generate"]:
        print(f"batch {g['batch']}: emad {g['emad_tokens_per_s']:.1f} tok/s, HF {g['hf_tokens_per_s']:.1f} tok/s, "
              f"time ratio {g['time_ratio_emad_over_hf']:.3f}, identical {g['identical_tokens_until_eos']}")
    lr = result["layer_vs_readout"]
    print(f"one layer {lr['layer_s'] * 1e3:.2f} ms, one readout {lr['readout_s'] * 1e3:.2f} ms "
          f"(readout = {lr['readout_over_layer']:.1f} layers); written to {path}")


if __name__ == "__main__":
    main()
