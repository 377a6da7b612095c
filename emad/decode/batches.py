"""Which teacher-forced requests a sweep scores together in one pass (:meth:`emad.decode.Sweep.score_batch`).

As lm-eval's ``Collator`` orders its requests: longest first (a batch's first request fixes its padded width, so
the requests of a batch are of similar lengths, and memory peaks at the first batch), requests with the same prompt
side by side and in one batch where they fit (the prompt runs once for all their continuations). A batch holds at
most ``size`` requests and, when ``tokens`` is given, at most ``tokens`` padded tokens: its continuations × (its
longest prompt + its longest continuation), the slots its continuation pass holds. The batches depend on the
requests alone, so every process that scores a task's requests forms the same ones (a shard of a screen is a list
of them, :mod:`emad.evaluation.shards`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from emad.decode.results import Request


def width(request: Request) -> int:
    """Tokens of a request's longest row: its prompt and its longest continuation."""
    prompt, continuations = request
    return len(prompt) + max(len(c) for c in continuations)


def padded_tokens(requests: Sequence[Request]) -> int:
    """Slots a batch of ``requests`` holds: its continuations × (longest prompt + longest continuation)."""
    rows = sum(len(cs) for _, cs in requests)
    return rows * (max(len(p) for p, _ in requests) + max(len(c) for _, cs in requests for c in cs))


AUTO = "auto"  # decode.sweep_batch: as many requests as the memory bound lets a pass hold (:func:`auto_tokens`)


def check_batch(size: int | str, tokens: int | None = None) -> None:
    """Raises ValueError naming ``decode.sweep_batch`` (``decode.sweep_batch_tokens``) when it is not a whole number
    >= 1 or ``auto`` (None: no bound on tokens)."""
    if size != AUTO and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"decode.sweep_batch = {size!r}: requests per sweep pass must be a whole number >= 1, or "
                         f"{AUTO} (as many as decode.sweep_batch_tokens, or the free memory, lets a pass hold)")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"decode.sweep_batch_tokens = {tokens!r}: padded tokens per sweep pass must be a whole "
                         f"number >= 1, or null (no bound)")


def request_batches(requests: Sequence[Request], size: int | str, tokens: int | None = None) -> list[list[int]]:
    """The requests' indices in batches (module docstring): longest first, equal prompts together; each batch at
    most ``size`` requests and ``tokens`` padded tokens (a request over ``tokens`` alone is a batch of its own).

    Raises:
        ValueError: naming the parameter, for a ``size`` or ``tokens`` that is not a whole number >= 1.
    """
    check_batch(size, tokens)
    size = len(requests) or 1 if size == AUTO else size
    order = sorted(range(len(requests)), key=lambda i: (-width(requests[i]), tuple(requests[i][0]), i))
    groups: list[list[int]] = []  # requests with one prompt, side by side
    for i in order:
        if groups and tuple(requests[groups[-1][0]][0]) == tuple(requests[i][0]):
            groups[-1].append(i)
        else:
            groups.append([i])
    batches: list[list[int]] = []
    for group in groups:
        for at in range(0, len(group), size):  # a prompt with more requests than a batch holds spans several
            part = group[at:at + size]
            batch = batches[-1] if batches else None
            if batch is not None and len(batch) + len(part) <= size and (tokens is None or padded_tokens(
                    [requests[i] for i in batch + part]) <= tokens):
                batch += part
            else:
                batches.append(list(part))
    return batches


@dataclass(frozen=True)
class Batching:
    """How a sweep batches a task's requests: at most ``size`` requests (``auto``: no count) and ``tokens`` padded
    tokens a pass (``decode.sweep_batch``, ``decode.sweep_batch_tokens``)."""

    size: int | str = 1
    tokens: int | None = None

    @classmethod
    def of(cls, size: int | str, tokens: int | None, stack, methods: Sequence) -> Batching:
        """The batching ``decode.sweep_batch`` and ``decode.sweep_batch_tokens`` give, on ``stack`` for a sweep of
        ``methods``: with ``auto`` and no token bound, the bound that fills a quarter of the free memory
        (:func:`auto_tokens`)."""
        if size == AUTO and tokens is None:
            tokens = auto_tokens(stack, methods)
        return cls(size, tokens)

    def __post_init__(self):
        check_batch(self.size, self.tokens)

    def batches(self, requests: Sequence[Request]) -> list[list[int]]:
        """:func:`request_batches` of ``requests``."""
        return request_batches(requests, self.size, self.tokens)


ONE = Batching()  # one request a pass


def free_memory(device) -> int:
    """Bytes free for a pass on ``device``: the GPU's free memory, or the host's available memory (Linux
    ``MemAvailable``; 8 GiB where it cannot be read)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in open("/proc/meminfo").read().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def token_bytes(stack, methods: Sequence) -> int:
    """Bytes a sweep pass holds per padded token, at most: its K/V at every layer, its states at every kept layer,
    and where a criterion keeps every probe's distribution of the rows it runs (contrastive), those."""
    config, elem = stack.config, stack.head.weight.element_size()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    criteria = [m.criterion for m in methods if hasattr(m, "criterion")]  # strategies score alone
    probes = {p for c in criteria for p in c.probes(stack.n_layers)}
    out = stack.n_layers * 2 * heads * head_dim * elem + len(probes) * config.hidden_size * elem
    if any(c.name == "contrastive" for c in criteria):
        out += len(probes) * stack.vocab_size * 4 * 2  # each probe's log-probabilities and probabilities, fp32
    return out


def auto_tokens(stack, methods: Sequence, share: float = 0.25) -> int:
    """Padded tokens a sweep pass may hold in ``share`` of the free memory (:func:`free_memory`,
    :func:`token_bytes`), at least 256. Depends on the memory free when the stage starts: the batches, and so the
    scores' float rounding, may differ from one run to the next."""
    return max(256, int(share * free_memory(stack.device) / token_bytes(stack, methods)))
