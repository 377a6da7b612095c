"""The model sections of ``make gpu-check`` (benchmarks/gpu_check.py): decode speed at one batch size, C2's dry run,
and exactness that explains itself. Each takes the shared :class:`Bundle` (one model, its compiled stack and a quick
profile, loaded once), a deadline it stops working at, and a ``progress`` callback that gets what is known so far.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_decode import PROMPTS, bench_batch, checks, decoders, load, profile_of  # noqa: E402

from emad.decode import Method, generate, left_pad  # noqa: E402
from emad.decode.compare import Readouts, divergence  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Emad, Full  # noqa: E402
from emad.exits.estimators import TopK  # noqa: E402


class Bundle:
    """One model in one dtype, its eager and compiled stacks and (made on first use) a quick profile.

    Args:
        spec, device, dtype: what to load (:func:`bench_gpu_decode.load`).
        compiled: ``compiled(base)`` makes the compiled stack (gpu_check's :func:`compiled_stack`).
    """

    def __init__(self, spec: str, device: str, dtype: str, compiled):
        self.model, self.tokenizer, self.description = load(spec, device, dtype)
        self.dtype = dtype
        self.base = LayerStack(self.model)
        self.stack = compiled(self.base)
        self._profile = None

    @property
    def profile(self):
        if self._profile is None:
            self._profile = profile_of(self.base, self.tokenizer)
        return self._profile

    def prompts(self, batch: int) -> list[list[int]]:
        """The benchmark's prompts as token ids, ``batch`` of them (repeated past their number)."""
        return [self.tokenizer(p)["input_ids"] for p in (PROMPTS * batch)[:batch]]


def _steps(stack, tokenizer, prompts, methods: dict, new: int, deadline: float) -> dict:
    """Host reads and graph launches per decode step of each decoder (one generation each, after its warm-up);
    decoders past ``deadline`` are left out."""
    out = {}
    for name, method in methods.items():
        if time.perf_counter() > deadline:
            break
        generate(stack, tokenizer, prompts, method(), new, eos_token_ids=[])
        made = generate(stack, tokenizer, prompts, method(), new, eos_token_ids=[])
        launches = made.graph_launches
        out[name] = {"step_path": made.step_path, "host_reads_per_token": made.host_reads_per_step,
                     "graph_launches_per_token": launches / made.decode_steps if launches is not None else None}
    return out


def section_decode(bundle: Bundle, batch: int, args, deadline: float, progress) -> dict:
    """Per-token time of HF ``generate`` and of each decoder on the compiled engine at ``batch`` rows
    (:func:`bench_gpu_decode.bench_batch`), the targets beside the ratios, host reads and graph launches per token."""
    out = {"model": bundle.description, "batch": batch}
    measured = bench_batch(bundle.model, bundle.tokenizer, {"compiled": bundle.stack}, bundle.profile, batch, args,
                           deadline, lambda partial: progress({**out, **partial}))
    out.update(measured, checks=checks(measured))
    progress(out)
    out["steps"] = _steps(bundle.stack, bundle.tokenizer, bundle.prompts(batch),
                          decoders(bundle.stack.n_layers, bundle.profile), args.short, deadline)
    return out


def section_c2(bundle: Bundle, new: int) -> dict:
    """C2's timing (:func:`emad.evaluation.speed.time_prompts`) of EMAD (exact and Top-K) on two prompts: it fails
    if a timed block compiles or captures."""
    from emad.evaluation.speed import time_prompts

    methods = [Method(Emad(bundle.profile, 0.0)), Method(Emad(bundle.profile, 0.0), "monotone", TopK(1024))]
    timed = time_prompts(bundle.stack, bundle.tokenizer, methods, bundle.prompts(2), new)
    return {"prompts": 2, "new_tokens": new, "built_nothing_while_timed": True,
            "points": [{key: t[key] for key in ("speedup", "speed_reference", "decode_speedup", "speed_pairs",
                                                "decode_speed_pairs")} for t in timed]}


def _generation(stack, tokenizer, prompts, method, new: int) -> tuple:
    readouts = Readouts()
    out = generate(stack, tokenizer, prompts, method, new, eos_token_ids=[], on_logits=readouts)
    return out, readouts


def _hf_greedy(model, prompts, new: int) -> tuple[list[list[int]], Readouts]:
    """HF greedy ``generate`` of exactly ``new`` tokens per prompt and the logits each token was chosen from."""
    ids, real = left_pad(prompts, 0, model.device)
    made = model.generate(ids, attention_mask=real.long(), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    readouts = Readouts()
    for t, logits in enumerate(made.logits):
        readouts(t, logits)
    return made.sequences[:, ids.shape[1]:].tolist(), readouts


def section_exactness(bundle_of, dtypes: list[str], batch: int, new: int, deadline: float, progress) -> dict:
    """The compiled engine against the eager one (full depth and EMAD exiting) and HF greedy (full depth), per
    dtype: the yes-or-no of each, and where and by how much they part (:func:`emad.decode.compare.divergence`:
    first differing token and step, shares of equal tokens and depths, the largest logit difference there and each
    side's margin). ``bundle_of(dtype)`` gives the model in that dtype (the decode sections' where it is theirs)."""
    out: dict = {"batch": batch, "new_tokens": new}
    for dtype in dtypes:
        if time.perf_counter() > deadline:
            out[dtype] = {"skipped": "budget"}
            continue
        bundle = bundle_of(dtype)
        prompts = bundle.prompts(batch)
        rows = out[dtype] = {}
        hf_tokens, hf_readouts = _hf_greedy(bundle.model, prompts, new)
        profile = bundle.profile
        methods = {"full": lambda: Method(Full()), "emad-exits": lambda p=profile: Method(Emad(p, 0.0))}
        for name, method in methods.items():
            if time.perf_counter() > deadline:
                rows[name] = {"skipped": "budget"}
                continue
            eager, eager_logits = _generation(bundle.base, bundle.tokenizer, prompts, method(), new)
            compiled, compiled_logits = _generation(bundle.stack, bundle.tokenizer, prompts, method(), new)
            against = divergence(eager.token_ids, compiled.token_ids, eager.depths, compiled.depths, eager_logits,
                                 compiled_logits)
            row = {"compiled_equals_eager_tokens": eager.token_ids == compiled.token_ids,
                   "compiled_equals_eager_depths": eager.depths == compiled.depths,
                   "rows": len(prompts), "compiled_vs_eager": against}
            if name == "full":
                row["rows_equal_hf_greedy"] = sum(t == h for t, h in zip(compiled.token_ids, hf_tokens))
                row["compiled_vs_hf"] = divergence(hf_tokens, compiled.token_ids, a_readouts=hf_readouts,
                                                   b_readouts=compiled_logits)
                row["eager_vs_hf"] = divergence(hf_tokens, eager.token_ids, a_readouts=hf_readouts,
                                                b_readouts=eager_logits)
            rows[name] = row
            progress(out)
    return out


def bundle_cache(spec: str, device: str, compiled):
    """``bundle_of(dtype)``: one :class:`Bundle` per dtype, loaded on first use and kept."""
    made: dict[str, Bundle] = {}

    def bundle_of(dtype: str) -> Bundle:
        if dtype not in made:
            made[dtype] = Bundle(spec, device, dtype, compiled)
        return made[dtype]

    bundle_of.made = made
    return bundle_of


def dynamo_graphs() -> int:
    """Graphs dynamo compiled in this process so far (ours and any other's, HF's ``generate`` included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

