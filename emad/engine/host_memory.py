"""Give freed tensors' memory back to the operating system on a glibc host.

glibc's ``malloc`` serves a request above its mmap threshold with its own mapping, returned on ``free``; but it
raises that threshold to the size of each such block freed (up to 32 MiB), so a process that frees many large
tensors (a readout ``[m, V]`` is megabytes) soon serves them from its heaps, which keep their high-water mark. A
teacher-forced screen of the powered plan held 12 GB resident for 0.6 GB of live tensors that way. Fixing the
threshold keeps every block of at least :data:`THRESHOLD` bytes in its own mapping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

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
