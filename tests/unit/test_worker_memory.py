"""A worker's memory follows what it holds now: buffers it has freed go back to the OS."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from tests.jobs import ROOT

# After a 4 MB buffer is freed, glibc by default serves buffers up to 4 MB from the heap; a
# worker's must still get mappings of their own. Prints the bytes glibc holds in mappings while
# a 1 MB buffer is alive.
_MAPPED_WHILE_HELD = """
import ctypes, sys
from omniload.workers import worker
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "worker":
    worker.map_large_buffers()
big = bytearray(4 << 20)
del big
held = bytearray(1 << 20)
print(libc.mallinfo2().hblkhd)
"""


def _glibc_reports_mappings() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_reports_mappings(), reason="glibc's allocator (2.33 or later: mallinfo2)")
@pytest.mark.timeout(60)
def test_a_worker_maps_large_buffers_even_after_freeing_a_larger_one():
    def mapped(kind: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _MAPPED_WHILE_HELD, kind], capture_output=True, text=True, timeout=30, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert mapped("worker") >= 1 << 20
    assert mapped("default") < 1 << 20  # glibc's own way, which the worker changes
