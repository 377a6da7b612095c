"""Freed large tensors go back to the operating system (emad.engine.host_memory): after one large block is freed,
plain glibc serves the next large-ish request from its heap; with the threshold fixed it is mapped on its own. Free
pages that small blocks pin inside the heap are handed back on request."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, sys, torch
from emad.engine.host_memory import return_large_frees
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "fixed":
    assert return_large_frees()
big = torch.empty(2 << 20)  # 8 MiB, mapped: freeing it raises plain glibc's threshold to 8 MiB
del big
before = libc.mallinfo2().hblkhd  # bytes in blocks mapped on their own
t = torch.empty(int(sys.argv[2]) // 4)  # float32
print(libc.mallinfo2().hblkhd - before)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                           or ctypes.util.find_library("c") is None, reason="glibc's malloc only")


def _mapped_bytes(mode: str, size: int) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(size)], capture_output=True, text=True, check=True)
    return int(out.stdout)


@glibc
def test_a_large_block_is_mapped_on_its_own_after_a_larger_one_was_freed():
    size = 2 << 20
    assert _mapped_bytes("plain", size) == 0  # what the fix changes: the heap serves it, and keeps its high-water mark
    assert _mapped_bytes("fixed", size) >= size


FRAGMENT = """
import sys, torch
from emad.engine.host_memory import release_free, return_large_frees
assert return_large_frees()
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
kept, large = [], []
for _ in range(200):  # 512 KiB blocks (below the threshold: heap) with a small block kept after each
    large.append(torch.ones(128 << 10))
    kept.append(torch.ones(4 << 10))
large.clear()  # 100 MiB free inside the heap, pinned by the small blocks
before = rss()
released = release_free() if sys.argv[1] == "release" else False
print(released, before - rss())
"""


@glibc
def test_free_pages_pinned_inside_the_heap_are_handed_back():
    def run(mode: str) -> tuple[bool, int]:
        out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, check=True)
        released, dropped = out.stdout.split()
        return released == "True", int(dropped)

    assert run("keep")[1] < 10 << 20  # freed, but still resident
    released, dropped = run("release")
    assert released and dropped > 80 << 20


def test_a_trim_within_the_interval_of_the_last_is_skipped(monkeypatch):
    from emad.engine import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(host_memory, "_last_trim", [float("-inf")])
    assert host_memory.release_free(min_interval=3600.0)  # the first trims
    assert not host_memory.release_free(min_interval=3600.0)  # an hour has not passed
    assert host_memory.release_free()  # no interval: always
    assert calls == [0, 0]
