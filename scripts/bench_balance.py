"""Per-step compute balance across data-parallel ranks: omniload's planner vs per-rank packing.

Length mix (per document): 70% web-like, lognormal with median 600 tokens; 25% code, median
1500; 5% long, uniform 8k-32k tokens. Documents longer than seq_len are split into chunks,
each its own causal document. Cost of a segment: the attention cost model a*len^2 + b*len + c
with omniload's defaults (a ~1B-parameter model).

Baseline (colocated): each rank draws its own documents until its rows x seq_len are full and
packs them first-fit decreasing; what does not fit waits for its next step. omniload: the
same draw for the whole global batch, assigned by the planner. Printed per side: mean over
steps of max/mean rank cost, mean ratio of the max to the lower bound (max(mean, largest
segment)), and the simulated step-time speedup (sum over steps of the max rank cost,
baseline / omniload). Then the planner's time per step at DP=8 and DP=1024.

    python scripts/bench_balance.py [--steps 500] [--dp 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.packer import Segment, chunk_bounds
from omniload.coordinator.plan.step_plan import plan_step
from omniload.spec import DEFAULT_COST_COEFFS

_NO_TOKENS = np.zeros(0, dtype=np.int32)


def draw_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    kind = rng.random(n)
    web = rng.lognormal(np.log(600), 0.9, n)
    code = rng.lognormal(np.log(1500), 0.9, n)
    long = rng.uniform(8192, 32768, n)
    return np.maximum(1, np.where(kind < 0.70, web, np.where(kind < 0.95, code, long))).astype(np.int64)


class DocStream:
    def __init__(self, seed: int, seq_len: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._seq_len = seq_len
        self._buffer: list[int] = []
        self._next_id = 0

    def take(self, tokens: int) -> list[Segment]:
        """Documents (as segments) until at least `tokens` tokens are drawn."""
        segments = []
        while tokens > 0:
            if not self._buffer:
                self._buffer = draw_lengths(self._rng, 4096).tolist()[::-1]
            length = self._buffer.pop()
            for start, stop in chunk_bounds(length, self._seq_len):
                segments.append(Segment(0, self._next_id, stop - start, _NO_TOKENS))
                self._next_id += 1
            tokens -= length
        return segments


def first_fit_decreasing(segments: list[Segment], rows: int, seq_len: int) -> tuple[list[Segment], list[Segment]]:
    free = [seq_len] * rows
    placed, left = [], []
    for segment in sorted(segments, key=lambda s: -s.length):
        row = next((r for r, room in enumerate(free) if room >= segment.length), None)
        if row is None:
            left.append(segment)
        else:
            free[row] -= segment.length
            placed.append(segment)
    return placed, left


def simulate(steps: int, dp: int, rows: int, seq_len: int, seed: int = 0) -> dict[str, float]:
    cost = cost_function("attention", DEFAULT_COST_COEFFS, ["mix"])
    seg_cost = lambda segs: (
        float(cost(np.array([s.length for s in segs], dtype=np.int64), None, 0).sum()) if segs else 0.0
    )  # noqa: E731
    capacity = rows * seq_len
    ranks = [DocStream(seed * 1000 + r, seq_len) for r in range(dp)]
    carries: list[list[Segment]] = [[] for _ in range(dp)]
    stream, carry = DocStream(seed, seq_len), []
    figures = {
        k: []
        for k in (
            "base_imbalance",
            "base_to_bound",
            "base_max",
            "ours_imbalance",
            "ours_to_bound",
            "ours_max",
            "plan_s",
        )
    }
    for _ in range(steps):
        costs = []
        largest = 0.0
        for r in range(dp):
            need = capacity - sum(s.length for s in carries[r])
            placed, carries[r] = first_fit_decreasing(carries[r] + ranks[r].take(need), rows, seq_len)
            costs.append(seg_cost(placed))
            largest = max([largest] + [seg_cost([s]) for s in placed])
        mean = float(np.mean(costs))
        figures["base_imbalance"].append(max(costs) / mean)
        figures["base_to_bound"].append(max(costs) / max(mean, largest))
        figures["base_max"].append(max(costs))

        fresh = stream.take(dp * capacity - sum(s.length for s in carry))
        started = time.perf_counter()
        plan = plan_step(carry, fresh, dp, rows, seq_len, cost)
        figures["plan_s"].append(time.perf_counter() - started)
        carry = plan.carry
        figures["ours_imbalance"].append(plan.figures["imbalance"])
        figures["ours_to_bound"].append(plan.figures["to_bound"])
        figures["ours_max"].append(plan.figures["max_cost"])
    return {
        "base_imbalance": float(np.mean(figures["base_imbalance"])),
        "base_to_bound": float(np.mean(figures["base_to_bound"])),
        "ours_imbalance": float(np.mean(figures["ours_imbalance"])),
        "ours_to_bound": float(np.mean(figures["ours_to_bound"])),
        "speedup": sum(figures["base_max"]) / sum(figures["ours_max"]),
        "plan_ms": 1000 * float(np.mean(figures["plan_s"])),
        "plan_ms_p95": 1000 * float(np.percentile(figures["plan_s"], 95)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--large-dp", type=int, default=1024)
    parser.add_argument("--large-steps", type=int, default=3)
    args = parser.parse_args()
    r = simulate(args.steps, args.dp, args.rows, args.seq_len)
    print(
        f"DP={args.dp}, seq_len {args.seq_len} x rows {args.rows}, {args.steps} steps, attention cost "
        f"a,b,c = {DEFAULT_COST_COEFFS}"
    )
    print(f"{'':<34}{'baseline':>10}{'omniload':>10}")
    print(f"{'mean max/mean rank cost':<34}{r['base_imbalance']:>10.3f}{r['ours_imbalance']:>10.3f}")
    print(f"{'mean max / lower bound':<34}{r['base_to_bound']:>10.3f}{r['ours_to_bound']:>10.3f}")
    print(f"simulated step-time speedup (sum of max rank cost, baseline / omniload): {r['speedup']:.2f}x")
    print(f"planner time per step at DP={args.dp}: mean {r['plan_ms']:.1f} ms, p95 {r['plan_ms_p95']:.1f} ms")
    big = simulate(args.large_steps, args.large_dp, args.rows, args.seq_len)
    print(
        f"planner time per step at DP={args.large_dp}: mean {big['plan_ms']:.0f} ms, p95 {big['plan_ms_p95']:.0f} ms "
        f"(max / lower bound {big['ours_to_bound']:.3f})"
    )


if __name__ == "__main__":
    main()
