"""How a job's figures read for people: `omniload status`'s table and launch's progress line.

Pure: a status snapshot (coordinator/observe/figures.py, also `job.status()` and `status --json`) in,
text out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_RANKS_SHOWN = 16  # the slowest ranks; a job of thousands gets a summary line for the rest


def render(status: dict[str, Any]) -> str:
    steps, planner = status["steps"], status["planner"]
    ended = f", data ends at step {steps['final']}" if steps["final"] is not None else ""
    lines = [
        f"omniload job {status['job']}  up {status['uptime_s']:.0f}s  step {steps['planned']} planned, "
        f"{steps['slowest']} consumed by every rank{ended}; {_si(status['delivered']['tokens_per_s'])} "
        "tokens/s delivered",
        "",
    ]
    lines.append(
        f"{'source':<16}{'read docs/s':>12}{'tokens/s':>11}{'ring':>6}{'workers':>8}{'cpu%':>7}"
        f"{'restarts':>9}{'epoch':>6}  cursor"
    )
    for s in status["sources"]:
        lines.append(
            f"{s['name'][:15]:<16}{s['docs_per_s']:>12.1f}{_si(s['tokens_per_s']):>11}"
            f"{s['ring_fill']:>6.0%}{s['workers']:>8}{s['worker_cpu_percent']:>7.1f}{s['restarts']:>9}"
            f"{s['epoch']:>6}  {s['cursor'][0]}:{s['cursor'][1]}"
        )
    remote = [s for s in status["sources"] if s.get("store_fetched_mb") or s.get("store_retries")]
    if remote:
        lines += ["", f"{'store reads':<16}{'fetched MB':>12}{'held MB':>9}{'retries':>9}"]
        for s in remote:
            lines.append(
                f"{s['name'][:15]:<16}{s['store_fetched_mb']:>12.1f}{s['read_ahead_mb']:>9.1f}{s['store_retries']:>9}"
            )
    long_chats = [s for s in status["sources"] if s.get("chats_truncated") or s.get("chats_dropped")]
    if long_chats:
        lines += ["", f"{'long chats':<16}{'truncated':>12}{'dropped':>9}"]
        for s in long_chats:
            lines.append(f"{s['name'][:15]:<16}{s['chats_truncated']:>12}{s['chats_dropped']:>9}")
    ranks = sorted(status["ranks"], key=lambda r: (r["step"], r["rank"]))
    if ranks:
        lines += ["", f"{'rank':>6}{'step':>8}{'lag':>6}{'wait%':>7}{'credits':>8}  connection"]
        for r in ranks[:_RANKS_SHOWN]:
            lines.append(
                f"{r['rank']:>6}{r['step']:>8}{r['lag']:>6}{r['wait_percent']:>7.1f}{r['credits']:>8}  "
                f"{r['connection']}{' via ' + r['via'] if r.get('via') else ''}"
            )
        rest = ranks[_RANKS_SHOWN:]
        if rest:
            lines.append(
                f"{'':>6}... {len(rest)} more ranks at steps {rest[0]['step']}-{rest[-1]['step']}, "
                f"waiting {_mean(r['wait_percent'] for r in rest):.1f}% on average"
            )
    lines += ["", _planner_line(planner)]
    if "memory_mb" in status:
        lines.append(_memory_line(status["memory_mb"]))
    workers = status.get("workers", {})
    if workers.get("autoscale"):
        lines.append(f"workers: {workers['count']} running of {workers['budget']}, {workers['moves']} moves")
    if status["waiting_for"]:
        lines.append(f"waiting: {status['waiting_for']}")
    return "\n".join(lines)


def progress_line(status: dict[str, Any]) -> str:
    """One line for launch's stderr: step, tokens/s, slowest rank, wait %, planner ms."""
    tokens = status["delivered"]["tokens_per_s"]
    ranks = status["ranks"]
    slowest = min(ranks, key=lambda r: (r["step"], r["rank"]), default=None)
    who = f"slowest rank {slowest['rank']} at step {slowest['step']}" if slowest else "no rank yet"
    wait = _mean(r["wait_percent"] for r in ranks)
    line = (
        f"omniload: step {status['steps']['slowest']} | {_si(tokens)} tokens/s | {who} | ranks wait "
        f"{wait:.0f}% | planner {status['planner']['ms_per_step']:.1f} ms/step"
    )
    return line + (" | waiting for a rank" if status["waiting_for"] else "")


def _planner_line(planner: dict[str, Any]) -> str:
    if not planner["steps"]:
        return "planner: no step planned yet"
    weights = " ".join(f"{name}={w:.2f}" for name, w in planner.get("weights", {}).items())
    return (
        f"planner: {planner['steps']} steps, {planner['ms_per_step']:.1f} ms/step (last {planner['last_ms']:.1f}), "
        f"max/mean cost {planner['imbalance']:.3f} (max/lower bound {planner.get('to_bound', 1.0):.3f}), "
        f"carry {planner['carry']} segments, weights {weights}{_diversity(planner)}"
    )


def _diversity(planner: dict[str, Any]) -> str:
    """The last step's documents and, per source, the most of its tokens one document held."""
    if "documents" not in planner:
        return ""
    top = " ".join(f"{name}={share:.1%}" for name, share in planner.get("top_doc_share", {}).items())
    return f"; {planner['documents']} documents, top document share {top}"


def _memory_line(memory: dict[str, float]) -> str:
    heap = f", heap {memory['coordinator_heap']:.0f} MB" if "coordinator_heap" in memory else ""
    rings = f"; rings {memory['rings']:.0f} MB of read-ahead" if "rings" in memory else ""
    return (
        f"memory: coordinator {memory['coordinator']:.0f} MB RSS{heap}; workers {memory['workers']:.0f} MB RSS "
        f"(shared pages counted in each){rings}"
    )


def _si(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def _mean(values: Iterable[float]) -> float:
    listed = list(values)
    return sum(listed) / len(listed) if listed else 0.0
