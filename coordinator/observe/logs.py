"""Logging for the coordinator process: one prefixed line per event on stderr."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("omniload: %(message)s"))
    logger = logging.getLogger("omniload")
    logger.handlers[:] = [handler]
    logger.setLevel(os.environ.get("OMNILOAD_LOG", "WARNING").upper())
    logger.propagate = False
