"""Give freed tensors' memory back to the operating system on a glibc host.

glibc's ``malloc`` serves a request above its mmap threshold with its own mapping, returned on ``free``; but it
raises that threshold to the size of each such block freed (up to 32 MiB), so a process that frees many large
tensors (a readout ``[m, V]`` is megabytes) soon serves them from its heaps, which keep their high-water mark. A
teacher-forced screen of the powered plan held 12 GB resident for 0.6 GB of live tensors that way. Fixing the
threshold keeps every block of at least :data:`THRESHOLD` bytes in its own mapping.

A heap still fragments where small blocks that live long (the states a screen keeps) fall between large ones that
are freed: the holes left are too small for the next large request, so the heap grows while most of it is free.
:func:`release_free` hands the free pages of a heap back (``malloc_trim``); a loop that keeps small results per
step calls it each step, at most once a second. Without it the powered plan's screen held 4.05 GB resident (2.88 GB
of it free in the heap) after 40 multiple-choice items, for 0.09 GB of live tensors. (A lower threshold maps those
blocks too, but every activation of a 256-token batch is then a fresh mapping: at 128 KiB the default run took
18 min 12 s, against 16 min 22 s with the trim.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD = 1 << 20  # bytes: a block this large or larger is mapped on its own and unmapped when freed


@functools.cache
def return_large_frees() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` for this process (once); False where the C library has no
    ``mallopt`` (not glibc) or refuses it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library has none)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_last_trim = [float("-inf")]  # time.monotonic() of the last malloc_trim


def release_free(min_interval: float = 0.0) -> bool:
    """Hand every whole free page of the heaps back to the operating system (glibc's ``malloc_trim(0)``), unless
    the last call that did was less than ``min_interval`` seconds ago (a trim walks the whole heap). True when some
    memory was released; False when none was, the call was skipped, or the C library has no ``malloc_trim``."""
    trim, now = _malloc_trim(), time.monotonic()
    if trim is None or now - _last_trim[0] < min_interval:
        return False
    _last_trim[0] = now
    return bool(trim(0))
