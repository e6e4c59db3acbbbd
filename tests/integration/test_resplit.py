"""A re-split (the autoscaler's move) with real workers and rings: the lanes that move keep
their read-ahead, so the planner reads on at once, and the documents are those of no move."""

from __future__ import annotations

import asyncio
import time

import pytest

from omniload.coordinator.pool.catalog import build_catalog
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.pool.supervision import Supervisor
from omniload.coordinator.pool.workforce import Workforce
from omniload.spec import Spec
from tests.corpus import mixed_sources

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# two lanes per source; the move regroups them: each worker then serves one source's lanes
_BY_LANE = [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)]]
_BY_SOURCE = [[(0, 0), (0, 1), (2, 0)], [(1, 0), (1, 1), (2, 1)]]
_DOCS = 400  # per source, about half of them read before the move
_WAIT_S = 30.0


def _read(intake: SourceIntake, count: int) -> list[tuple[int, int, int, bytes]]:
    """The next `count` documents of a source, as (group, pos, ordinal, tokens)."""
    docs, deadline = [], time.monotonic() + _WAIT_S
    while len(docs) < count:
        doc = intake.poll()
        if doc is None:
            assert time.monotonic() < deadline, f"source '{intake.catalog.name}' sent nothing for {_WAIT_S:.0f}s"
            time.sleep(0.001)
            continue
        docs.append((doc.group, doc.pos, doc.ordinal, doc.tokens.tobytes()))
    return docs


def _run(spec: Spec, move: bool) -> tuple[list[list[tuple]], list[int]]:
    """Every source's first _DOCS documents, and (with `move`) how many bytes each ring still
    held the moment the re-split's new workers had started."""
    workforce = Workforce(spec, build_catalog(spec), _BY_LANE, "resplit")
    held: list[int] = []
    try:
        intakes = workforce.read_rings()
        workforce.start()

        async def read() -> list[list[tuple]]:
            def fail(where: str, exc: BaseException) -> None:
                raise AssertionError(f"{where}: {exc}")

            supervisor = Supervisor(workforce.pool, intakes, 0, fail)
            supervisor.watch_all()
            try:
                docs = [_read(intake, _DOCS // 2) for intake in intakes]
                if move:
                    await supervisor.replan(_BY_SOURCE)
                    held.extend(ring.used() for ring in workforce.pool.rings.values())
                for got, intake in zip(docs, intakes):
                    got += _read(intake, _DOCS - len(got))
                return docs
            finally:
                await supervisor.close()

        return asyncio.run(read()), held
    finally:
        workforce.stop()


def test_a_resplit_keeps_the_read_ahead_and_changes_no_document(corpus):
    spec = Spec.from_dict({"sources": mixed_sources(corpus), "seq_len": 64, "seed": 7, "epochs": 0, "ring_mb": 1})
    static, _ = _run(spec, move=False)
    moved, held = _run(spec, move=True)

    for name, a, b in zip(("web", "code", "books"), static, moved):
        assert [d[:3] for d in b] == [d[:3] for d in a], f"source '{name}': the move changed the order"
        assert b == a, f"source '{name}': the move changed a document's tokens"
    assert all(held), f"a moved lane's ring was emptied (bytes held per ring: {held}): the planner would wait"
