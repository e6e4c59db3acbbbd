"""User transforms (`module:function`) that misbehave on purpose, for the failure tests."""

from __future__ import annotations

import os
import time

import numpy as np


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


def burn_bytes(text: str) -> np.ndarray:
    """The byte tokens after CPU work that costs a few microseconds per token, hundreds of
    times the tokenizing (thread CPU time, which the autoscaler measures: a sleep would not).
    BURN_BYTES_ROUNDS=0 in the job's environment gives the same tokens at no cost: a reference
    run that only needs the batches."""
    tokens = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    mixed = tokens.copy()
    for _ in range(int(os.environ.get("BURN_BYTES_ROUNDS", 1000))):
        mixed = (mixed * 1103515245 + 12345) & 0x7FFFFFFF
    return tokens if mixed.sum() >= 0 else mixed


TRANSFORMED: list[str] = []  # what counted_bytes was given, in this process


def counted_bytes(text: str) -> list[int]:
    """The byte tokens, each value given recorded: which rows a worker's lanes transformed."""
    TRANSFORMED.append(text)
    return list(text.encode())
