"""omniload: one coordinator per job plans every global batch and ships packed batches to ranks.

`connect`/`Loader` (the rank client, which needs torch) and `Job` are loaded on first use,
so the coordinator and the workers, which import `omniload.spec` and friends, never import
torch: a torch import costs hundreds of MB per process, and memory is the point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniload.errors import ConfigError, OmniloadError, SourceFailed
from omniload.spec import Source, Spec

if TYPE_CHECKING:
    from omniload.client import Loader
    from omniload.job import Job
    from omniload.rank_entry import connect

__all__ = ["ConfigError", "Job", "Loader", "OmniloadError", "Source", "SourceFailed", "Spec", "connect"]
__version__ = "0.1.0"

_LAZY = {"connect": "omniload.rank_entry", "Loader": "omniload.client", "Job": "omniload.job"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'omniload' has no attribute {name!r}")
