"""Give freed tensors' memory back to the operating system on a glibc host.

glibc's ``malloc`` serves a request above its mmap threshold with its own mapping, returned on ``free``; but it
raises that threshold to the size of each such block freed (up to 32 MiB), so a process that frees many large
tensors (a readout ``[m, V]`` is megabytes) soon serves them from its heaps, which keep their high-water mark. A
teacher-forced screen of the powered plan held 12 GB resident for 0.6 GB of live tensors that way. Fixing the
threshold keeps every block of at least :data:`THRESHOLD` bytes in its own mapping.

The threshold is glibc's initial one, 128 KiB: a readout of a few rows (``[4, V]`` is 0.8 MB on a 49k vocabulary)
must be mapped too. With 1 MiB, the powered plan's multiple-choice items (4 continuations of up to 6 tokens) left
their readouts in the heap between the small states the screen keeps, which pinned it: 40 items of its screen held
4.05 GB resident (2.88 GB of it free in the heap) for 0.09 GB of live tensors, against 1.19 GB at 128 KiB, in the
same time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD = 128 << 10  # bytes: a block this large or larger is mapped on its own and unmapped when freed


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
