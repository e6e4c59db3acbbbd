"""A worker's memory follows what it holds now: large buffers it frees go back to the OS."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from tests.jobs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# After a 4 MB buffer is freed, glibc by default serves buffers up to that size from the heap;
# a worker's must still be mapped. Prints the bytes glibc maps for a 1 MB buffer (the growth of
# its mapped total while the buffer lives: imports leave mapped blocks of their own).
_MAPPED_FOR_A_BUFFER = """
import ctypes, sys
from omniload.workers import worker
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "worker":
    worker.set_up_allocators()
big = bytearray(4 << 20)
del big
before = libc.mallinfo2().hblkhd
held = bytearray(1 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _glibc_reports_mappings() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_reports_mappings(), reason="glibc's allocator (2.33 or later: mallinfo2)")
def test_a_worker_maps_large_buffers_even_after_freeing_a_larger_one():
    def mapped(kind: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _MAPPED_FOR_A_BUFFER, kind], capture_output=True, text=True, timeout=30, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert mapped("worker") >= 1 << 20
    assert mapped("default") == 0  # glibc's own way, which the worker changes
