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

# two lanes per source on three workers; the move to _SPREAD hands source 1's lanes from
# workers 0 and 1 to worker 2, the move back returns them; every worker runs on
_PAIRED = [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0), (2, 1)]]
_SPREAD = [[(0, 0)], [(0, 1)], [(1, 0), (1, 1), (2, 0), (2, 1)]]
_DOCS = 600  # per source: a third read before the first move, a third before the second
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


def _run(spec: Spec, move: bool) -> tuple[list[list[tuple]], list[tuple[int, int]], list[bool]]:
    """Every source's first _DOCS documents; with `move`, each ring's bytes held just before and
    just after each move (nothing reads the rings meanwhile), and whether every worker ran on
    (its process the same)."""
    workforce = Workforce(spec, build_catalog(spec), _PAIRED, "resplit")
    held: list[tuple[int, int]] = []
    ran_on: list[bool] = []
    try:
        intakes = workforce.read_rings()
        workforce.start()

        async def read() -> list[list[tuple]]:
            def fail(where: str, exc: BaseException) -> None:
                raise AssertionError(f"{where}: {exc}")

            supervisor = Supervisor(workforce.pool, intakes, 0, fail)
            supervisor.watch_all()
            try:
                docs: list[list[tuple]] = [[] for _ in intakes]
                for plan in (_SPREAD, _PAIRED, None):
                    for got, intake in zip(docs, intakes):
                        got += _read(intake, _DOCS // 3)
                    if move and plan is not None:
                        pids = [workforce.pool.started(w).pid for w in range(len(plan))]
                        rings = list(workforce.pool.rings.values())
                        before = [ring.used() for ring in rings]
                        assert await supervisor.replan(plan) == (2, 0)  # source 1's two lanes, no restart
                        held.extend(zip(before, (ring.used() for ring in rings)))
                        ran_on.append(pids == [workforce.pool.started(w).pid for w in range(len(plan))])
                return docs
            finally:
                await supervisor.close()

        return asyncio.run(read()), held, ran_on
    finally:
        workforce.stop()


def test_a_resplit_keeps_the_read_ahead_and_changes_no_document(corpus):
    spec = Spec.from_dict({"sources": mixed_sources(corpus), "seq_len": 64, "seed": 7, "epochs": 0, "ring_mb": 1})
    static, _, _ = _run(spec, move=False)
    moved, held, ran_on = _run(spec, move=True)

    for name, a, b in zip(("web", "code", "books"), static, moved):
        assert [d[:3] for d in b] == [d[:3] for d in a], f"source '{name}': a move changed the order"
        assert b == a, f"source '{name}': a move changed a document's tokens"
    # workers may only have written more meanwhile: a ring holding less was emptied by the move
    assert all(after >= before for before, after in held), (
        f"a move emptied a ring (bytes held before and after, per ring: {held}): the planner would wait"
    )
    assert ran_on == [True, True], "a move restarted a worker"
