"""omniload: one coordinator per job plans every global batch and ships packed batches to ranks.

A training rank imports only the client (`connect`) and the spec; `Job` is loaded on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from omniload.client import Loader, connect
from omniload.errors import ConfigError, OmniloadError, SourceFailed
from omniload.spec import Source, Spec

if TYPE_CHECKING:
    from omniload.job import Job

__all__ = ["ConfigError", "Job", "Loader", "OmniloadError", "Source", "SourceFailed", "Spec", "connect"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "Job":
        from omniload.job import Job

        return Job
    raise AttributeError(f"module 'omniload' has no attribute {name!r}")
