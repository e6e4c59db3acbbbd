"""A tokenizer module (`module:function`) that imports in the coordinator but not in a source
worker, as one needing a file or a device only some processes can see would."""

from __future__ import annotations

import multiprocessing

if multiprocessing.current_process().name.startswith("omniload-worker"):
    raise RuntimeError("no tokenizer model in this process")


def tokenize(text: str) -> list[int]:
    return list(text.encode())
