"""Every wait, timeout and deadline is timed with the monotonic clock: the wall clock may jump
(NTP, a VM resumed), and a job must not time out or hang when it does. (The end-to-end case:
tests/integration/test_chaos.py, a clock that jumps an hour each way under a running job.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where the wall clock is what is meant: a file's age on disk is a wall-clock difference
_WALL_CLOCK_ALLOWED = {"omniload/storage/disk_cache.py"}


def _wall_clock_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("time", "now", "utcnow")
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("time", "datetime")
    ]


def test_no_wait_or_timeout_reads_the_wall_clock():
    found = {}
    for folder in ("omniload", "coordinator", "workers"):
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if path.is_symlink() or relative.startswith(("omniload/coordinator/", "omniload/workers/")):
                continue  # the links to the two folders: read once, from the folders
            if relative not in _WALL_CLOCK_ALLOWED and (lines := _wall_clock_calls(path)):
                found[relative] = lines
    assert not found, f"wall-clock reads (use time.monotonic for waits and timeouts): {found}"
