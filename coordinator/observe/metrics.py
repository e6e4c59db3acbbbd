"""`--metrics-port`: the job's figures in the Prometheus text format at /metrics.

`exposition` is pure: the status snapshot (coordinator/observe/figures.py) in, the text out, so the
endpoint and `omniload status` can never disagree. The HTTP side answers one GET per
connection, as Prometheus scrapes, and nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

_REQUEST_S = 10.0
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, where in the snapshot)
_JOB = [
    ("omniload_steps_planned", "gauge", "Steps the planner has planned.", lambda s: s["steps"]["planned"]),
    ("omniload_steps_consumed_min", "gauge", "Steps every rank has consumed.", lambda s: s["steps"]["slowest"]),
    (
        "omniload_delivered_tokens_total",
        "counter",
        "Real (non-padding) tokens of the steps every rank consumed.",
        lambda s: s["delivered"]["tokens"],
    ),
    (
        "omniload_planner_steps_total",
        "counter",
        "Steps planned since the coordinator started.",
        lambda s: s["planner"]["steps"],
    ),
    (
        "omniload_planner_step_seconds",
        "gauge",
        "Mean time to plan and encode a step, waiting for records included.",
        lambda s: s["planner"]["ms_per_step"] / 1000,
    ),
    (
        "omniload_planner_imbalance",
        "gauge",
        "Max / mean rank cost of the last step.",
        lambda s: s["planner"].get("imbalance", 1.0),
    ),
    (
        "omniload_planner_to_bound",
        "gauge",
        "Max rank cost of the last step over its lower bound, max(mean rank cost, costliest segment).",
        lambda s: s["planner"].get("to_bound", 1.0),
    ),
    (
        "omniload_planner_step_documents",
        "gauge",
        "Distinct documents in the last step.",
        lambda s: s["planner"].get("documents", 0),
    ),
    (
        "omniload_planner_carry_segments",
        "gauge",
        "Segments carried to the next step.",
        lambda s: s["planner"].get("carry", 0),
    ),
    (
        "omniload_ranks_waiting_for_one",
        "gauge",
        "1 while the ranks wait for one slow or missing rank.",
        lambda s: int(s["waiting_for"] is not None),
    ),
]
_SOURCE = [
    ("omniload_source_docs_total", "counter", "Documents the planner read from the source.", "docs"),
    ("omniload_source_tokens_total", "counter", "Tokens the planner read from the source.", "tokens"),
    ("omniload_source_ring_fill_ratio", "gauge", "How full the source's rings are (0-1).", "ring_fill"),
    ("omniload_source_worker_cpu_percent", "gauge", "CPU of the workers serving the source.", "worker_cpu_percent"),
    ("omniload_source_restarts_total", "counter", "Restarts of the source's workers.", "restarts"),
    ("omniload_source_epoch", "gauge", "The epoch the source's cursor is in.", "epoch"),
    (
        "omniload_source_store_retries_total",
        "counter",
        "Requests to the source's store retried after a transient error.",
        "store_retries",
    ),
    (
        "omniload_source_store_fetched_bytes_total",
        "counter",
        "Bytes fetched from the source's store.",
        lambda s: int(s["store_fetched_mb"] * 2**20),
    ),
    (
        "omniload_source_read_ahead_bytes",
        "gauge",
        "Bytes of the source's objects its lanes hold now.",
        lambda s: int(s["read_ahead_mb"] * 2**20),
    ),
]
_RANK = [
    ("omniload_rank_steps_consumed", "gauge", "Steps the rank has acknowledged.", "step"),
    ("omniload_rank_lag_steps", "gauge", "Steps planned that the rank has not consumed.", "lag"),
    (
        "omniload_rank_wait_ratio",
        "gauge",
        "Share of the last second the rank waited for a batch.",
        lambda r: r["wait_percent"] / 100,
    ),
    ("omniload_rank_credits", "gauge", "Batches the rank may still be sent.", "credits"),
    (
        "omniload_rank_connected",
        "gauge",
        "1 while the rank is connected.",
        lambda r: int(r["connection"] == "connected"),
    ),
]


def exposition(status: dict[str, Any]) -> str:
    lines: list[str] = []
    for name, kind, text, value in _JOB:
        _family(lines, name, kind, text, [("", value(status))])
    weights = status["planner"].get("weights", {})
    _family(
        lines,
        "omniload_mixture_weight",
        "gauge",
        "The weight each source drew with in the last step.",
        [(_labels(source=n), w) for n, w in weights.items()],
    )
    _family(
        lines,
        "omniload_step_top_document_share",
        "gauge",
        "The largest share of the source's tokens in the last step that came from one document.",
        [(_labels(source=n), s) for n, s in status["planner"].get("top_doc_share", {}).items()],
    )
    for rows, label, families in ((status["sources"], "source", _SOURCE), (status["ranks"], "rank", _RANK)):
        for name, kind, text, key in families:
            get = key if callable(key) else (lambda row, key=key: row[key])
            key_of = "name" if label == "source" else "rank"
            _family(lines, name, kind, text, [(_labels(**{label: row[key_of]}), get(row)) for row in rows])
    return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {float(value)!r}" for labels, value in samples]


def _labels(**labels: Any) -> str:
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def serve_metrics(snapshot: Callable[[], dict[str, Any]]) -> Callable:
    """The `client_connected_cb` of the metrics server."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_S):
                request = await reader.readuntil(b"\r\n\r\n")
            method, path, *_ = request.split(b" ", 2) + [b"", b""]
            if method != b"GET" or path.split(b"?")[0] not in (b"/metrics", b"/"):
                _respond(writer, b"404 Not Found", b"omniload serves GET /metrics\n", "text/plain")
            else:
                _respond(writer, b"200 OK", exposition(snapshot()).encode(), _CONTENT_TYPE)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away or sent no request: nothing to answer
        finally:
            writer.close()

    return serve


def _respond(writer: asyncio.StreamWriter, status: bytes, body: bytes, content_type: str) -> None:
    writer.write(
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + content_type.encode()
        + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
    )
