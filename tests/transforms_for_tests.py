"""User transforms (`module:function`) that misbehave on purpose, for the failure tests."""
from __future__ import annotations

import os
import time


def exit3(text: str) -> list[int]:
    os._exit(3)


def hang(text: str) -> list[int]:
    while True:
        time.sleep(1)


def slow_bytes(text: str) -> list[int]:
    time.sleep(0.002)
    return list(text.encode())


def fail_on_seven(text: str) -> list[int]:
    if "7" in text:
        raise ValueError("seven is not allowed")
    return list(text.encode())
