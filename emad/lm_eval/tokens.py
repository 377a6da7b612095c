"""How lm-eval requests become token ids for the ``emad`` model: by default exactly as lm-eval's own ``hf`` model
(``HFLM``) does it, so that at full depth ``--model emad`` reproduces ``--model hf``.

- Encoding: the tokenizer's own special tokens unless ``add_bos_token`` says otherwise (lm-eval's
  ``_add_special_kwargs``); a text that already starts with the prefix token's string gets none added.
- ``(context, continuation)``: trailing spaces of the context move to the continuation and the continuation is
  what encoding the whole adds to the context's ids; an empty context becomes the prefix token (BOS, else EOS)
  unless the continuation already starts with it (lm-eval's ``TemplateLM.loglikelihood``).
- Truncation: the context is cut on the left so that context + continuation hold at most ``max_length + 1`` tokens
  (the model reads all but the last), as ``HFLM._loglikelihood_tokens``; a generation prompt keeps its last
  ``max_length - max_gen_toks`` tokens.
- Rolling windows (``loglikelihood_rolling``): :class:`RollingWindows` — lm-eval's (``max_length``-token windows,
  one token of context) by default, or EMAD's perplexity windows with a prefix when ``rolling_window`` is given.

One difference remains where ``max_length`` is the model's whole context: the engine takes at most that many
tokens of context + continuation, the last (unread) continuation token included, so such a request keeps one
context token fewer than ``HFLM`` and lm-eval's windows hold ``max_length - 1`` tokens. A shorter ``max_length``
removes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from lm_eval import utils as lm_utils
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

from emad.decode import ContextLengthError


@dataclass(frozen=True)
class RollingWindows:
    """How ``loglikelihood_rolling`` cuts a text into scored windows; every token is scored exactly once.

    Attributes:
        window: None for lm-eval's windows (``HFLM``: windows of the model's ``max_length`` tokens, each later one
            conditioned on the single token before it); else EMAD's perplexity windows (DESIGN §4, the
            perplexity task's ``window``/``prefix``): ``window`` tokens each, prefix included.
        prefix: tokens of context before each later EMAD window (prefilled at full depth, not scored); the first
            window's context is the prefix token. None with ``window=None``.
    """

    window: int | None = None
    prefix: int | None = None

    @classmethod
    def from_args(cls, window: int | None, prefix: int | None, max_length: int | None) -> RollingWindows:
        """Validated windows from the ``rolling_window`` / ``rolling_prefix`` model_args (prefix default: a quarter
        of the window); ``max_length`` None checks all but the window's upper bound (before the model is loaded).

        Raises:
            ValueError: naming the argument and its valid range.
        """
        if window is None:
            if prefix is not None:
                raise ValueError(f"rolling_prefix={prefix!r} sets the prefix of EMAD perplexity windows and needs "
                                 "rolling_window=<tokens per window>; leave both out for lm-eval's own windows")
            return cls()
        prefix = max(window // 4, 1) if prefix is None and _is_int(window) else prefix
        for name, value in (("rolling_window", window), ("rolling_prefix", prefix)):
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if window < 2:
            raise ValueError(f"rolling_window must be an integer >= 2 (at most max_length), got {window}")
        if max_length is not None and window > max_length:
            raise ValueError(f"rolling_window must be in 2..{max_length} (max_length), got {window}")
        if not 1 <= prefix < window:
            raise ValueError(f"rolling_prefix must be in 1..{window - 1} (below rolling_window), got {prefix}")
        return cls(window, prefix)

    def pairs(self, tokens: list[int], prefix_token: int, room: int) -> Iterator[tuple[list[int], list[int]]]:
        """``(context, continuation)`` pairs that score every token of ``tokens`` once.

        Args:
            tokens: the text's ids.
            prefix_token: the first window's context.
            room: most tokens of context + continuation a request may hold (``max_length + 1``: the last
                continuation token is predicted, never read).
        """
        if self.window is None:  # HFLM.loglikelihood_rolling: max_seq_len = max_length, context_len = 1
            max_seq_len, context_len = room - 1, 1
        else:  # windows of `window` tokens: pairs span max_seq_len + 1 tokens
            max_seq_len, context_len = self.window - 1, self.prefix
        windows = lm_utils.get_rolling_token_windows(token_list=tokens, prefix_token=prefix_token,
                                                     max_seq_len=max_seq_len, context_len=context_len)
        return map(lm_utils.make_disjoint_window, windows)

    def describe(self) -> str:
        if self.window is None:
            return "lm-eval's (max_length tokens, 1 token of context)"
        return f"EMAD perplexity windows of {self.window} tokens, {self.prefix} of them context"


@dataclass
class RequestEncoder:
    """Token ids of lm-eval requests, as lm-eval's ``hf`` model makes them (see the module docstring).

    Attributes:
        tokenizer: the model's tokenizer (with ``add_bos_token`` applied when given, as ``HFLM`` passes it on
            loading).
        add_bos_token: None keeps the tokenizer's own special tokens; True or False overrides them.
        prefix_token_id: the token that conditions an empty context.
        max_length: tokens of context the model reads.
        room: most tokens of context + continuation a request may hold.
        rolling: the windows of ``loglikelihood_rolling``.
    """

    tokenizer: object
    add_bos_token: bool | None
    prefix_token_id: int
    max_length: int
    room: int
    rolling: RollingWindows

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Ids of ``text`` (``HFLM.tok_encode``)."""
        kwargs = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(text, self.tokenizer.decode(self.prefix_token_id)):
            kwargs["add_special_tokens"] = False
        return list(self.tokenizer.encode(text, **kwargs))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids (``TemplateLM.loglikelihood`` and ``_encode_pair``)."""
        if not context:
            ids = self.encode(continuation, add_special_tokens=False)
            return ([self.prefix_token_id], ids) if not ids or ids[0] != self.prefix_token_id else (ids[:1], ids[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, prompt = self.encode(context + continuation), self.encode(context)
        return prompt, whole[len(prompt):]

    def fit(self, prompt: list[int], continuation: list[int]) -> list[int]:
        """The context, cut on the left so that context + continuation fit ``room`` tokens."""
        if len(continuation) > self.room - 1:
            raise ContextLengthError(f"a continuation of {len(continuation)} tokens leaves no room for its context "
                                     f"within max_length {self.max_length}")
        return prompt[-(self.room - len(continuation)):]

    def rolling_windows(self, text: str) -> Iterator[tuple[list[int], list[int]]]:
        """``(context, continuation)`` pairs of ``loglikelihood_rolling`` for ``text``."""
        return self.rolling.pairs(self.encode(text), self.prefix_token_id, self.room)

    def generation_prompt(self, context: str, max_new: int) -> list[int]:
        """Ids of a generation context, cut to its last ``max_length - max_new`` tokens (``HFLM.generate_until``;
        its batch encoder skips special tokens when the text starts with the BOS string). An empty context is
        the prefix token."""
        if max_new >= self.max_length:
            raise ContextLengthError(f"max_gen_toks {max_new} leaves no room for a prompt within max_length "
                                     f"{self.max_length}")
        bos = getattr(self.tokenizer, "bos_token", None)
        special = False if has_bos_prefix(context, bos) else self.add_bos_token
        ids = list(self.tokenizer(context, **_add_special_kwargs(special))["input_ids"])
        return (ids or [self.prefix_token_id])[-(self.max_length - max_new):]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
