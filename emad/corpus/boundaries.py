"""Cutting text at whitespace boundaries to a token budget: the longest head or tail that fits.

Token counts grow with the text nearly always, so both searches are binary searches over the boundaries; a
candidate is accepted only once counted, so the result never exceeds the budget.
"""

from __future__ import annotations

import re
from collections.abc import Callable

BOUNDARY = re.compile(r"\s+")
TAIL_CHARS_PER_TOKEN = 32  # a tail search first looks at the last limit × 32 characters (no token is longer)


def truncate_to_budget(text: str, limit: int, count_tokens: Callable[[str], int]) -> tuple[str, int]:
    """The longest prefix of `text` that ends at a whitespace boundary and fits `limit` tokens, and its count.

    The prefix is right-stripped. Returns ("", 0) when not even the first word fits.
    """
    cuts = [m.start() for m in BOUNDARY.finditer(text)] + [len(text)]
    best, best_n = "", 0
    lo, hi = 0, len(cuts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        prefix = text[: cuts[mid]].rstrip()
        n = count_tokens(prefix) if prefix else 0
        if n <= limit:
            if len(prefix) > len(best):
                best, best_n = prefix, n
            lo = mid + 1
        else:
            hi = mid - 1
    return best, best_n


def tail_within_budget(text: str, limit: int, count_tokens: Callable[[str], int]) -> tuple[str, int] | None:
    """The longest suffix of `text` that starts a word (after whitespace, or at the start) within `limit` tokens.

    Returns:
        (suffix, its token count), or None when the whole of `text` holds fewer than `limit` tokens (there is
        not a full budget of text before its end) or no word boundary leaves a suffix that fits.
    """
    window = text[-limit * TAIL_CHARS_PER_TOKEN:]
    if len(window) < len(text) and count_tokens(window) < limit:
        window = text  # unusually long tokens: search the whole text
    if count_tokens(window) < limit:
        return None
    whole = len(window) == len(text)
    cuts = ([0] if whole or text[-len(window) - 1].isspace() else []) + [m.end() for m in BOUNDARY.finditer(window)]
    best = None
    lo, hi = 0, len(cuts) - 1
    while lo <= hi:  # counts fall as the cut moves right: find the leftmost cut that fits
        mid = (lo + hi) // 2
        suffix = window[cuts[mid]:]
        n = count_tokens(suffix) if suffix else 0
        if n <= limit:
            if suffix and (best is None or len(suffix) > len(best[0])):
                best = suffix, n
            hi = mid - 1
        else:
            lo = mid + 1
    return best
