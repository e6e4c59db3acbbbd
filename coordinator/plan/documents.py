"""What the planner reads: a source's documents in its deterministic order, and the interface
of whatever hands them over (the coordinator's intake over the rings, coordinator/pool/intake.py;
a list in memory in tests and benchmarks). Declared here so that planning depends on no pool,
ring or process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True)  # not frozen, as packer.Segment, and for its reason: one is made per document
class Doc:
    source: int
    ordinal: int
    tokens: np.ndarray
    group: int = 0  # where the document sits in its source's order
    pos: int = 0
    image_at: np.ndarray | None = None  # where each image's placeholder tokens start
    pixels: np.ndarray | None = None  # uint8 [images, 3, H, W]
    after: tuple[int, int] = (0, 0)  # the intake's cursor right after this document (before any SKIP past it)
    mask: np.ndarray | None = None  # a conversation's label mask: uint8, 1 where a token is a trained target

    @property
    def origin(self) -> tuple[int, int]:
        return self.group, self.pos


class NamedSource(Protocol):
    """The source a document source reads (its catalog's index and name)."""

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...


class DocumentSource(Protocol):
    """One source's documents in order; the cursor `(group, pos)` is the next one (omniload.order)."""

    @property
    def catalog(self) -> NamedSource: ...

    @property
    def cursor(self) -> tuple[int, int]: ...

    @property
    def dry(self) -> bool:
        """Whether the source has ended: nothing more will come."""
        ...

    group: int

    def seek(self, group: int, pos: int) -> None: ...

    def epoch_end(self, group: int) -> int:
        """The first group of the epoch after the one that holds `group`."""
        ...

    def poll(self, until_group: int | None = None) -> Doc | None:
        """The next document if it is here (and its group is below `until_group`), else None."""
        ...
