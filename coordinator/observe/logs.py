"""Logging for the coordinator process: one prefixed line per event on stderr."""

from __future__ import annotations

import logging
import os
import sys

from omniload.storage.urls import redact


class _Redacting(logging.Formatter):
    """Every line with secrets (credentials, signed URLs, secret variables' values) masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Redacting("omniload: %(message)s"))
    logger = logging.getLogger("omniload")
    logger.handlers[:] = [handler]
    logger.setLevel(os.environ.get("OMNILOAD_LOG", "WARNING").upper())
    logger.propagate = False
