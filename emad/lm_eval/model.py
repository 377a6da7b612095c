"""The ``emad`` model for lm-eval: log-likelihoods and generations under a method's adaptive exits.

``loglikelihood`` and ``loglikelihood_rolling`` score with :func:`~emad.decode.score_adaptive` (the prompt at
full depth, the continuation with generation semantics: the depths the generator would choose);
``generate_until`` runs :func:`~emad.decode.generate`. Importing this module registers the model as ``emad``.

Rolling log-likelihood uses the perplexity windows of DESIGN §4 rather than the model's whole context: windows
of ``rolling_window`` tokens (default 256) whose first ``rolling_prefix`` tokens (default a quarter of the
window; in the first window, the prefix token) are context, so every token is scored exactly once. Under the
monotone policy one early exit caps every later token of its window, so the window length matters for adaptive
methods: keep it equal across the methods compared.

    lm_eval.simple_evaluate(model="emad", model_args="model=smollm2-135m,method=emad,"
                            "profile=data/profiles/smollm2-135m/stdlib-prose/profile.json,margin=0.2", tasks=[...])

model_args: ``model`` (alias ``pretrained``; embedded alias, local folder or hub id), the operating point
(``method``, ``depth``, ``threshold``, ``probe_every``, ``margin``, ``min_exit_layer``, ``policy``,
``estimator``, ``readout``; see :class:`~emad.evaluation.operating_point.PointConfig`), ``profile`` (profile.json),
``estimators`` (fitted estimators; default beside the profile), ``readouts`` (readouts.safetensors, for
``readout=tuned``), ``device``, ``dtype``, ``batch_size`` (generation rows per
batch), ``max_length`` (context in tokens; default the model's), ``rolling_window`` and ``rolling_prefix`` (see
above), ``add_bos_token`` (default: Gemma only) and ``seed`` (sampling). ``max_batch_size`` and
``trust_remote_code``, which lm-eval may pass, are accepted and ignored.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lm_eval.models  # noqa: F401  (the built-in models first: an empty registry is filled on first lookup)
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from emad.decode import ContextLengthError, Sampling, generate, score_adaptive
from emad.engine.stack import LayerStack
from emad.evaluation.operating_point import PointConfig, build_method, model_loader, point_from_options

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048  # for models whose config states no context length
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default
DEFAULT_ROLLING_WINDOW = 256  # as the perplexity task of params.yaml (window 256, prefix 64)
GENERATION_OPTIONS = ("until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_p")
OWN_ARGS = ("model", "pretrained", "profile", "estimators", "readouts", "device", "dtype", "batch_size", "max_length",
            "rolling_window", "rolling_prefix", "add_bos_token", "seed")  # model_args besides the operating point's


class ModelArgsError(ValueError):
    """A model_arg of the ``emad`` model is unknown, missing or invalid (the message names it)."""


@dataclass
class CostTally:
    """Tokens predicted, their summed depth and FLOPs, and the FLOPs of the same tokens at full depth."""

    tokens: int = 0
    depth_sum: int = 0
    flops: float = 0.0
    full_flops: float = 0.0

    def add(self, depths: Sequence[int], flops: float, full_flops: float) -> None:
        self.tokens += len(depths)
        self.depth_sum += sum(depths)
        self.flops += flops
        self.full_flops += full_flops

    @property
    def mean_depth(self) -> float:
        return self.depth_sum / self.tokens if self.tokens else 0.0

    @property
    def cost_ratio(self) -> float:
        return self.flops / self.full_flops if self.full_flops else 1.0


def _point(options: dict[str, Any]) -> PointConfig:
    """The operating point of the model_args, with errors that name the argument."""
    try:
        return point_from_options(options, "emad model_args")
    except ValueError as err:
        raise ModelArgsError(str(err)) from None


def _batch_size(value: Any) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        log.info("emad: batch_size=%s is not tuned automatically; generating one row at a time", value)
        return 1
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise ModelArgsError(f"emad model_args: batch_size must be a positive integer or 'auto', got {value!r}")
    return size


@register_model("emad")
class EmadLM(LM):
    """An lm-eval model that decodes with an EMAD operating point (see the module docstring for model_args)."""

    def __init__(self, model: str | None = None, pretrained: str | None = None, profile: str | None = None,
                 estimators: str | None = None, readouts: str | None = None, device: str | None = None,
                 dtype: str = "auto",
                 batch_size: int | str = 1, max_batch_size: int | None = None, max_length: int | None = None,
                 rolling_window: int | None = None, rolling_prefix: int | None = None,
                 add_bos_token: bool | None = None, seed: int = 0, trust_remote_code: bool | None = None,
                 **point_options: Any):
        super().__init__()
        if model is not None and pretrained is not None:
            raise ModelArgsError("emad model_args: give model= or pretrained= (the same thing), not both")
        spec = model or pretrained or "smollm2-135m"
        unknown = sorted(set(point_options) - set(PointConfig.model_fields))
        if unknown:
            valid = sorted({*PointConfig.model_fields, *OWN_ARGS})
            raise ModelArgsError(f"emad model_args: unknown argument(s) {', '.join(unknown)}; "
                                 f"valid: {', '.join(valid)}")
        point = _point(point_options)
        _check_profile(point, profile)
        self.batch_size = _batch_size(batch_size)
        self.seed = int(seed)
        self.loaded = _load(spec, device or "auto", dtype)
        self.tokenizer = self.loaded.tokenizer
        self.stack = LayerStack(self.loaded.model)
        try:
            self.method = build_method(point, self.stack.n_layers, self.loaded.fingerprint.as_dict(), profile,
                                       estimators, model_loader(device or "auto", dtype), readouts)
            self.method.bind(self.stack, self.tokenizer)
        except (ValueError, FileNotFoundError) as err:
            raise ModelArgsError(f"emad model_args: {err}") from None
        self._device = self.loaded.device
        self._max_length = _max_length(max_length, self.stack)
        self.rolling_window, self.rolling_prefix = _rolling(rolling_window, rolling_prefix, self._max_length)
        model_type = self.loaded.fingerprint.model_type
        self.add_bos_token = model_type.startswith("gemma") if add_bos_token is None else bool(add_bos_token)
        self.costs: dict[str, CostTally] = defaultdict(CostTally)
        log.info("emad: %s, method %s, %d layers, max_length %d", spec, json.dumps(self.method.describe()),
                 self.stack.n_layers, self._max_length)

    # --- tokens ----------------------------------------------------------------------------------------------

    @property
    def max_length(self) -> int:
        """Tokens of context (prompt + continuation) a request may use."""
        return self._max_length

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions an empty context (BOS, else EOS)."""
        for token in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id):
            if token is not None:
                return token
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to condition an empty context on")

    def tok_encode(self, text: str, special: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens (BOS) only where ``add_bos_token`` (or ``special``) asks."""
        special = self.add_bos_token if special is None else special
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Prompt and continuation ids as lm-eval's HF model splits them: trailing spaces of the context move to
        the continuation, the continuation is what encoding the whole adds to the context's ids."""
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation, special=False)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, prompt = self.tok_encode(context + continuation), self.tok_encode(context)
        return prompt, whole[len(prompt):]

    def _fit(self, prompt: list[int], continuation: list[int]) -> list[int]:
        """The prompt, cut on the left so that prompt + continuation fit ``max_length`` tokens."""
        if len(continuation) >= self.max_length:
            raise ContextLengthError(f"a continuation of {len(continuation)} tokens leaves no room for its context "
                                     f"within max_length {self.max_length}")
        return prompt[-(self.max_length - len(continuation)):]

    # --- lm-eval requests ------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), continuation is the greedy one)`` per request, adaptively scored."""
        out = []
        for request in tqdm(requests, desc="emad loglikelihood", disable=disable_tqdm):
            prompt, continuation = self.encode_pair(*request.args)
            result = self.score_tokens(prompt, continuation, "loglikelihood", greedy=True)
            self.cache_hook.add_partial("loglikelihood", request.args, result)
            out.append(result)
        self._report("loglikelihood")
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text after the prefix token, summed over :meth:`rolling_windows`; each
        window's context is prefilled at full depth and its tokens are scored with generation semantics."""
        out = []
        for request in tqdm(requests, desc="emad loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            total = sum(self.score_tokens(prompt, continuation, "loglikelihood_rolling", greedy=False)[0]
                        for prompt, continuation in self.rolling_windows(text))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            out.append(total)
        self._report("loglikelihood_rolling")
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context, generated with the method's exits until a stop string, EOS or
        ``max_gen_toks``; requests with equal generation options run in batches of ``batch_size``."""
        texts: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(i)
        bar = tqdm(total=len(requests), desc="emad generate_until", disable=disable_tqdm)
        for indices in groups.values():
            until, max_new, sampling = self.generation_settings(requests[indices[0]].args[1])
            prompts = {i: self._generation_prompt(requests[i].args[0], max_new) for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))  # similar lengths share a batch: less padding
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                out = generate(self.stack, self.tokenizer, [prompts[i] for i in batch], self.method, max_new,
                               sampling=sampling, stop_strings=until)
                for row, i in enumerate(batch):
                    texts[i] = out.texts[row]
                    self.costs["generate_until"].add(out.depths[row], sum(out.flops[row]), sum(out.full_flops[row]))
                    self.cache_hook.add_partial("generate_until", requests[i].args, out.texts[row])
                bar.update(len(batch))
        bar.close()
        self._report("generate_until")
        return texts

    # --- helpers -----------------------------------------------------------------------------------------------

    def rolling_windows(self, text: str) -> Iterator[tuple[list[int], list[int]]]:
        """(prompt, continuation) pairs of at most ``rolling_window`` tokens that score every token of ``text``
        once; prompts are the prefix token (first window) or the ``rolling_prefix`` tokens before the window."""
        windows = lm_utils.get_rolling_token_windows(
            token_list=self.tok_encode(text, special=False), prefix_token=self.prefix_token_id,
            max_seq_len=self.rolling_window - 1, context_len=self.rolling_prefix)  # pairs span max_seq_len + 1
        return map(lm_utils.make_disjoint_window, windows)

    def generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int, Sampling]:
        """Stop strings, token budget and sampling of lm-eval generation options (unsupported ones are ignored
        with a warning)."""
        kwargs = dict(gen_kwargs or {})
        ignored = sorted(set(kwargs) - set(GENERATION_OPTIONS))
        if ignored:
            log.warning("emad: ignoring unsupported generation option(s) %s", ", ".join(ignored))
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", DEFAULT_MAX_GEN_TOKS)))
        do_sample = bool(kwargs.get("do_sample", False))
        temperature = 1.0 if kwargs.get("temperature") is None else float(kwargs["temperature"])
        if do_sample and temperature <= 0:
            raise ValueError(f"do_sample needs a temperature > 0, got {temperature}")
        sampling = Sampling(do_sample=do_sample, temperature=temperature if do_sample else 1.0,
                            top_p=float(kwargs.get("top_p", 1.0) or 1.0), seed=self.seed)
        return until, max_new, sampling

    def _generation_prompt(self, context: str, max_new: int) -> list[int]:
        if max_new >= self.max_length:
            raise ContextLengthError(f"max_gen_toks {max_new} leaves no room for a prompt within max_length "
                                     f"{self.max_length}")
        prompt = self.tok_encode(context) if context else [self.prefix_token_id]
        return prompt[-(self.max_length - max_new):]

    def score_tokens(self, prompt: list[int], continuation: list[int], kind: str = "loglikelihood",
                     greedy: bool = True) -> tuple[float, bool]:
        """``(log P(continuation | prompt), is greedy)`` under the method, the prompt cut on the left to fit
        ``max_length``; costs are tallied under ``kind``; ``greedy=False`` skips the greedy check (False)."""
        if not continuation:
            return 0.0, True
        prompt = self._fit(prompt, continuation)
        scored = score_adaptive(self.stack, prompt, continuation, self.method)
        self.costs[kind].add(scored.depths, scored.flops, scored.full_flops)
        return sum(scored.logprobs), (all(scored.greedy) if greedy else False)

    def _report(self, kind: str) -> None:
        tally = self.costs[kind]
        log.info("emad %s: %d tokens, mean depth %.2f of %d, FLOPs ratio %.4f", kind, tally.tokens,
                 tally.mean_depth, self.stack.n_layers, tally.cost_ratio)

    # --- chat templates ----------------------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return self.loaded.fingerprint.spec.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return (getattr(self.tokenizer, "chat_template", None) or "") if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)


def _check_profile(point: PointConfig, profile: str | None) -> None:
    if point.needs_profile and profile is None:
        raise ModelArgsError(f"emad model_args: method={point.method} needs profile=<path to profile.json> (from the "
                             "smooth stage or `emad calibrate`)")


def _load(spec: str, device: str, dtype: str):
    from emad.engine.models import load_model

    try:
        return load_model(spec, device=device, dtype=dtype)
    except ValueError as err:  # a bad spec, device or dtype
        raise ModelArgsError(f"emad model_args: {err}") from None


def _max_length(value: int | None, stack: LayerStack) -> int:
    limit = stack.max_positions or DEFAULT_MAX_LENGTH
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= limit:
        raise ModelArgsError(f"emad model_args: max_length must be an integer in 2..{limit}, got {value!r}")
    return value


def _rolling(window: int | None, prefix: int | None, max_length: int) -> tuple[int, int]:
    """Rolling window and prefix; defaults: 256 tokens (at most ``max_length``) and a quarter of the window."""
    window = min(DEFAULT_ROLLING_WINDOW, max_length) if window is None else window
    prefix = max(window // 4, 1) if prefix is None and isinstance(window, int) else prefix
    for name, value in (("rolling_window", window), ("rolling_prefix", prefix)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelArgsError(f"emad model_args: {name} must be an integer, got {value!r}")
    if not 2 <= window <= max_length:
        raise ModelArgsError(f"emad model_args: rolling_window must be in 2..{max_length} (max_length), got {window}")
    if not 1 <= prefix < window:
        raise ModelArgsError(f"emad model_args: rolling_prefix must be in 1..{window - 1} (below rolling_window), "
                             f"got {prefix}")
    return window, prefix
