"""The event loop every omniload asyncio process runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop, or asyncio's own loop where uvloop is missing."""
    try:
        import uvloop
    except ImportError:  # uvloop is not on every platform; asyncio's loop works the same, slower
        return asyncio.run(main)
    return uvloop.run(main)
