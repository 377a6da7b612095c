"""The ``emad`` model for lm-eval: log-likelihoods and generations under a method's adaptive exits.

``loglikelihood`` and ``loglikelihood_rolling`` score with :func:`~emad.decode.score_adaptive` (the prompt at
full depth, the continuation with generation semantics: the depths the generator would choose);
``generate_until`` runs :func:`~emad.decode.generate`. Importing this module registers the model as ``emad``.

At full depth (``method=full``) it reproduces lm-eval's own ``--model hf`` by default: requests are tokenized,
truncated and windowed as ``HFLM`` does (:mod:`emad.lm_eval.tokens`): the tokenizer's own BOS handling,
``max_length`` resolved from the model's config as lm-eval resolves it, rolling log-likelihood over windows of
``max_length`` tokens, the EOS string added to the stop strings and lm-eval's generation options
(``max_gen_toks`` 256 and its aliases; ``do_sample`` implied by a temperature > 0). What still differs, and why:

- log-probabilities are computed in fp32 (DESIGN §3), ``HFLM`` in the model's dtype unless given
  ``softmax_dtype=float32``; equal in fp32, close in bf16.
- generation is greedy, or samples with ``temperature`` and ``top_p`` only: other options, and sampling settings
  in the model's ``generation_config``, are not applied (a warning names ignored options); sampled text follows
  another random stream than HF's.
- batched generation: rows never affect each other (each with its own positions), so results do not depend on
  ``batch_size`` (under ``batch_exit=sync`` a step's rows stop together, so they do); an empty generation
  context is the prefix token (BOS, else EOS).
- where ``max_length`` is the model's whole context, a truncated request keeps one context token fewer (see
  :mod:`emad.lm_eval.tokens`).

EMAD's perplexity windows (DESIGN §4) are an explicit model_arg: ``rolling_window=N`` scores each text in windows
of N tokens whose first ``rolling_prefix`` tokens (default N // 4; in the first window, the prefix token) are
context prefilled at full depth, as the pipeline's perplexity task (``window``/``prefix``). Under the monotone
policy one early exit caps every later token of its window, so the window length matters for adaptive methods:
keep it equal across the methods compared. Their scores are not comparable with ``--model hf``.

    lm_eval.simple_evaluate(model="emad", model_args="model=smollm2-135m,method=emad,"
                            "profile=data/profiles/smollm2-135m/stdlib-prose/profile.json,margin=0.2", tasks=[...])

model_args: ``model`` (alias ``pretrained``; embedded alias, local folder or hub id), the operating point
(``method``, ``depth``, ``threshold``, ``probe_every``, ``margin``, ``min_exit_layer``, ``policy``,
``estimator``, ``readout``, ``batch_exit``; see :class:`~emad.evaluation.operating_point.PointConfig`), ``profile``
(profile.json),
``estimators`` (fitted estimators; default beside the profile), ``readouts`` (readouts.safetensors, for
``readout=tuned``), ``device``, ``dtype``, ``batch_size`` (generation rows per batch), ``max_length`` (context in
tokens; default as lm-eval's ``hf``: the config's ``n_positions``, ``max_position_embeddings`` or ``n_ctx``, else
the tokenizer's ``model_max_length``, else 2048), ``rolling_window`` and ``rolling_prefix`` (EMAD windows, above;
default lm-eval's), ``add_bos_token`` (default: the tokenizer's own; True or False forces it, as for ``hf``) and
``seed`` (sampling). ``max_batch_size`` and ``trust_remote_code``, which lm-eval may pass, are accepted and ignored.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lm_eval.models  # noqa: F401  (the built-in models first: an empty registry is filled on first lookup)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, resolve_max_length
from tqdm import tqdm

from emad.decode import Sampling, generate, score_adaptive
from emad.engine.stack import LayerStack
from emad.evaluation.operating_point import PointConfig, build_method, model_loader, point_from_options
from emad.lm_eval.tokens import RequestEncoder, RollingWindows

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048  # lm-eval's HFLM default, for models whose config and tokenizer state no context length
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HFLM default
GENERATION_OPTIONS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")  # after normalize_gen_kwargs
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
        _check_token_args(max_length, rolling_window, rolling_prefix, add_bos_token)
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
        self.encoder = _encoder(self.tokenizer, self.stack, self.loaded.model.config, max_length, rolling_window,
                                rolling_prefix, add_bos_token)
        self.costs: dict[str, CostTally] = defaultdict(CostTally)
        log.info("emad: %s, method %s, %d layers, max_length %d, rolling windows: %s", spec,
                 json.dumps(self.method.describe()), self.stack.n_layers, self.max_length,
                 self.encoder.rolling.describe())

    # --- tokens ----------------------------------------------------------------------------------------------

    @property
    def max_length(self) -> int:
        """Tokens of context the model reads for a request."""
        return self.encoder.max_length

    @property
    def add_bos_token(self) -> bool | None:
        """None: the tokenizer's own special tokens; True or False: forced (lm-eval's ``add_bos_token``)."""
        return self.encoder.add_bos_token

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions an empty context (BOS, else EOS)."""
        return self.encoder.prefix_token_id

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text`` as lm-eval's ``hf`` model encodes it (see :mod:`emad.lm_eval.tokens`)."""
        return self.encoder.encode(text, add_special_tokens)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Prompt and continuation ids as lm-eval's ``hf`` model splits them."""
        return self.encoder.encode_pair(context, continuation)

    def rolling_windows(self, text: str) -> Iterator[tuple[list[int], list[int]]]:
        """(prompt, continuation) pairs of ``loglikelihood_rolling``: every token of ``text`` scored once."""
        return self.encoder.rolling_windows(text)

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
            prompts = {i: self.encoder.generation_prompt(requests[i].args[0], max_new) for i in indices}
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

    def generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int, Sampling]:
        """Stop strings (the EOS string added), token budget and sampling of lm-eval generation options,
        normalized as lm-eval's ``hf`` model does (unsupported options are ignored with a warning)."""
        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs or {}), DEFAULT_MAX_GEN_TOKS))
        ignored = sorted(set(kwargs) - set(GENERATION_OPTIONS))
        if ignored:
            log.warning("emad: ignoring unsupported generation option(s) %s", ", ".join(ignored))
        eos = self.tokenizer.eos_token_id
        eos_text = None if eos is None else self.tokenizer.decode(eos, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs["until"], eos=eos_text)
        do_sample, temperature = bool(kwargs["do_sample"]), float(kwargs.get("temperature") or 0.0)
        if do_sample and temperature <= 0:
            raise ValueError(f"do_sample needs a temperature > 0, got {temperature}")
        sampling = Sampling(do_sample=do_sample, temperature=temperature if do_sample else 1.0,
                            top_p=float(kwargs.get("top_p", 1.0) or 1.0), seed=self.seed)
        return until, int(kwargs["max_gen_toks"]), sampling

    def score_tokens(self, prompt: list[int], continuation: list[int], kind: str = "loglikelihood",
                     greedy: bool = True) -> tuple[float, bool]:
        """``(log P(continuation | prompt), is greedy)`` under the method, the prompt cut on the left to fit
        ``max_length``; costs are tallied under ``kind``; ``greedy=False`` skips the greedy check (False)."""
        if not continuation:
            return 0.0, True
        prompt = self.encoder.fit(prompt, continuation)
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


def _encoder(tokenizer, stack: LayerStack, config, max_length: int | None, rolling_window: int | None,
             rolling_prefix: int | None, add_bos_token: bool | None) -> RequestEncoder:
    """The request encoder of the model_args, as lm-eval's ``hf`` model would encode (errors name the argument)."""
    length = _max_length(max_length, stack, resolve_max_length(config, tokenizer, default=DEFAULT_MAX_LENGTH))
    try:
        rolling = RollingWindows.from_args(rolling_window, rolling_prefix, length)
    except ValueError as err:
        raise ModelArgsError(f"emad model_args: {err}") from None
    if add_bos_token is not None:
        try:
            tokenizer.add_bos_token = add_bos_token  # as HFLM passes it to the tokenizer it loads
        except ValueError as err:  # e.g. add_bos_token=True with no BOS token
            raise ModelArgsError(f"emad model_args: add_bos_token={add_bos_token}: {err}") from None
    prefix = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), None)
    if prefix is None:
        raise ModelArgsError("emad model_args: the tokenizer has neither a BOS nor an EOS token to condition an "
                             "empty context on")
    room = length + 1  # context + continuation: the last continuation token is never read (see tokens.py)
    return RequestEncoder(tokenizer, add_bos_token, prefix, length, room, rolling)


def _check_token_args(max_length: Any, rolling_window: Any, rolling_prefix: Any, add_bos_token: Any) -> None:
    """What can be checked of the tokenization model_args before the model is loaded."""
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ModelArgsError(f"emad model_args: max_length must be an integer >= 2, got {max_length!r}")
    if add_bos_token is not None and not isinstance(add_bos_token, bool):
        raise ModelArgsError(f"emad model_args: add_bos_token must be True or False, got {add_bos_token!r}")
    try:
        RollingWindows.from_args(rolling_window, rolling_prefix, max_length)
    except ValueError as err:
        raise ModelArgsError(f"emad model_args: {err}") from None


def _max_length(value: int | None, stack: LayerStack, resolved: int) -> int:
    """``max_length``: the given one (at most the model's context), else lm-eval's resolution of the config."""
    limit = stack.max_positions or resolved
    if value is None:
        return min(resolved, limit)
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= limit:
        raise ModelArgsError(f"emad model_args: max_length must be an integer in 2..{limit}, got {value!r}")
    return value
