"""Errors that cross module and process boundaries.

Each message names the cause and the fix; the CLI turns `ConfigError` into exit code 2.
"""

from __future__ import annotations


class OmniloadError(Exception):
    """Base class of every error omniload raises on purpose."""


class ConfigError(OmniloadError):
    """The job as specified cannot run: bad flag, bad file, bad layout. Exit code 2."""

    exit_code = 2


class ProtocolError(OmniloadError):
    """A peer sent bytes that are not a valid omniload frame."""


class SourceFailed(OmniloadError):
    """A source worker could not produce its data (corrupt file, transform error, crash).
    `bad_input`: the data is at fault (a bad file or sample), which exits with code 2."""

    def __init__(self, source: str, message: str, file: str | None = None, bad_input: bool = False) -> None:
        self.source = source
        self.file = file
        self.bad_input = bad_input
        where = f" ({file})" if file else ""
        super().__init__(f"source '{source}'{where}: {message}")
