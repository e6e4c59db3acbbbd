"""Per-step compute balance across data-parallel ranks, simulated: what a user runs today against
omniload's fixed rows (--rank-tokens fixed) and variable token budgets (--rank-tokens variable).

Document lengths, in tokens:
  corpus     the bench corpus's documents (scripts/bench_quality.py: the standard library's code,
             generated package documentation and Debian changelogs, at most 64,000 bytes each),
             byte tokens, drawn with its source weights (code 0.5, docs 0.3, changelogs 0.2 of
             the tokens)
  long-tail  a pretraining mix with long documents, shaped like ProLong's long-context mix
             (Gao et al. 2024, "How to Train Long-Context Language Models (Effectively)"): 40%
             of the tokens from short web-like documents (lognormal, median 1,000 tokens,
             sigma 1.2) and 60% from long ones (books, code repositories: Pareto with alpha 1.1
             from 8k tokens, cut at 512k)
Documents longer than seq_len are cut into seq_len chunks, each its own causal segment (the
existing long-document rule). Costs: the training FLOPs of Llama 1B, 8B and 70B with document
masking (--cost-model llama-1b|llama-8b|llama-70b; omniload/model_shape.py). Padding costs the
linear term (the matrices run over it; attention over padding is skipped).

Per setting (lengths, seq_len, dp, model), simulated step time per real token of
  (a) per-rank packing, what users run today: each rank draws its own documents and packs
      them in reading order, greedily into rows (a segment that does not fit the current row
      starts the next one; one that fits no row waits for the next step)
  (b) fixed rows: the global draw, omniload's planner (balance.assign) into rows x seq_len
  (c) variable budgets: the global draw, budgets.assign_budgets, one sequence a rank of at
      most 2 x rows x seq_len tokens, padded to a multiple of 128
  (d) ideal: each step's lower bound, max(mean rank cost, largest segment), no padding
Printed: rows of (a) full, the gain over (a) of (b), (c) and (d), and the share of the possible
improvement reached, (gain - 1) / (ideal - 1). A step step time is its most expensive rank.
Then the planner's time per step at dp=1024 with 64k-token ranks (--rank-tokens variable).

    python -m scripts.bench_balance [--steps 30] [--lengths corpus,long-tail] [--seqs 4096,...]
"""

from __future__ import annotations

import argparse
import itertools
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omniload.coordinator.plan.balance import assign
from omniload.coordinator.plan.budgets import assign_budgets, padded_length, padding_cost
from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.packer import Segment, chunk_bounds
from omniload.coordinator.plan.step_plan import plan_budgets
from omniload.coordinator.plan.stepper import Stepper
from omniload.model_shape import PRESETS
from omniload.order import sample_id
from omniload.spec import Spec
from scripts import quality_corpus
from scripts.harness import Figure, add_json_flag, commit, write_results
from tests.intakes import MemoryIntake

CACHE = Path.home() / ".cache" / "omniload" / "bench" / "balance-lengths-v2.npz"
PAD_TO = 128
MODELS = ("llama-1b", "llama-8b", "llama-70b")
RANK_TOKENS = 16384  # rows = max(1, RANK_TOKENS // seq_len): 4 x 4k, 2 x 8k, 1 x 32k, 1 x 128k
# bench_quality's corpus (its constants, so this reads the same documents without importing torch)
_QUALITY_WEIGHTS = {"code": 0.5, "docs": 0.3, "changelogs": 0.2}
_MAX_DOC_BYTES, _CORPUS_SEED, _DOCS_PACKAGES, _CHANGELOG_PACKAGES = 250 * 256, 20261124, 950, 5000

Sampler = Callable[[np.random.Generator, int], np.ndarray]  # (rng, n) -> n document lengths


def corpus_lengths() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lengths in byte tokens of the bench corpus's documents in reading order, each one's draw
    probability (its source's weight spread over the source's tokens, as the mixture draws) and
    source (0 code, 1 docs, 2 changelogs); cached, ~10 s to make."""
    if CACHE.exists():
        saved = np.load(CACHE)
        return saved["lengths"], saved["p"], saved["source"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = {
        "code": [
            min(len(p.read_bytes()), _MAX_DOC_BYTES)
            for p in sorted(stdlib.rglob("*.py"))
            if "site-packages" not in p.parts and "test" not in p.parts
        ],
        "docs": [len(t.encode()) for _, t in quality_corpus.docs(_CORPUS_SEED, _DOCS_PACKAGES, _MAX_DOC_BYTES)],
        "changelogs": [
            len(t.encode()) for _, t in quality_corpus.changelogs(_CORPUS_SEED + 1, _CHANGELOG_PACKAGES, _MAX_DOC_BYTES)
        ],
    }
    lengths, p, source = [], [], []
    for index, (name, found) in enumerate(sources.items()):
        kept = np.array([n for n in found if n >= 16], dtype=np.int64)
        lengths.append(kept)
        p.append(np.full(len(kept), _QUALITY_WEIGHTS[name] / kept.sum()))
        source.append(np.full(len(kept), index))
    lengths_all, p_all, source_all = np.concatenate(lengths), np.concatenate(p), np.concatenate(source)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    np.savez(CACHE, lengths=lengths_all, p=p_all / p_all.sum(), source=source_all)
    return lengths_all, p_all / p_all.sum(), source_all


def corpus_sampler() -> Sampler:
    lengths, p, _ = corpus_lengths()
    return lambda rng, n: lengths[rng.choice(len(lengths), n, p=p)]


def long_tail(rng: np.random.Generator, n: int) -> np.ndarray:
    """ProLong-like: 60% of the tokens in documents of 8k-512k tokens (Pareto, alpha 1.1), 40% in
    short ones (lognormal, median 1,000). Mean long length ~36k, short ~2k: a long document in
    every 13 makes 60% of the tokens."""
    short = np.exp(rng.normal(np.log(1000), 1.2, n))
    long = np.minimum(8192 * (1 - rng.random(n)) ** (-1 / 1.1), 524288)
    return np.maximum(1, np.where(rng.random(n) < 1 / 13, long, short)).astype(np.int64)


class Stream:
    """Documents from a seeded generator: whole, in drawing order (`document`, for per-rank
    packing), or as segments through a shuffle window (`take`, for the global draw: as
    omniload's window, it spreads a long document's chunks over many steps)."""

    def __init__(self, sample: Sampler, seed: int, seq_len: int, window: int = 0) -> None:
        self._sample, self._rng, self._seq_len = sample, np.random.default_rng(seed), seq_len
        self._docs: list[int] = []
        self._window = window or max(1 << 23 // seq_len, 4096)  # segments, as --shuffle-window's default
        self._segments: list[int] = []

    def document(self) -> list[int]:
        if not self._docs:
            self._docs = self._sample(self._rng, 1024).tolist()[::-1]
        n = self._docs.pop()
        return [stop - start for start, stop in chunk_bounds(n, self._seq_len)]

    def take(self, tokens: int) -> list[int]:
        """Segments until `tokens` are drawn (the last one may go past it)."""
        out: list[int] = []
        while tokens > 0:
            if not self._segments:
                while len(self._segments) < self._window:
                    self._segments += self.document()
                self._rng.shuffle(self._segments)
            out.append(self._segments.pop())
            tokens -= out[-1]
        return out


@dataclass(frozen=True)
class Setting:
    seq_len: int
    rows: int
    dp: int


def per_rank_packing(sample: Sampler, s: Setting, steps: int, seed: int) -> list[list[np.ndarray]]:
    """(a): per step, per rank, the segment lengths it packed in reading order into its rows.
    Rank r reads documents r, r + dp, r + 2 dp, ... of the documents the global draw shuffles
    (a DistributedSampler over the same data), so both sides see about the same documents."""
    stream = Stream(sample, seed, s.seq_len)
    dealt: list[list[list[int]]] = [[] for _ in range(s.dp)]  # per rank: documents dealt, not yet read
    dealt_to = 0
    pending: list[list[int]] = [[] for _ in range(s.dp)]
    out = []
    for _ in range(steps):
        step = []
        for r in range(s.dp):
            placed, row, used = [], 0, 0
            while row < s.rows:
                while not pending[r]:
                    while not dealt[r]:
                        dealt[dealt_to].append(stream.document())
                        dealt_to = (dealt_to + 1) % s.dp
                    pending[r] = dealt[r].pop(0)
                n = pending[r][0]
                if used + n <= s.seq_len:
                    used += n
                    placed.append(pending[r].pop(0))
                else:
                    row, used = row + 1, 0
            step.append(np.array(placed, dtype=np.int64))
        out.append(step)
    return out


def global_steps(sample: Sampler, s: Setting, steps: int, seed: int, place: Callable) -> list[tuple]:
    """(b), (c): the global draw of dp x rows x seq_len tokens a step (carried segments first,
    then fresh ones), placed by `place(lengths, carried) -> rank per segment (-1: carried)`;
    per step (lengths, ranks)."""
    stream, carry, out = Stream(sample, seed, s.seq_len), np.zeros(0, dtype=np.int64), []
    for _ in range(steps):
        fresh = stream.take(s.dp * s.rows * s.seq_len - int(carry.sum()))
        lengths = np.concatenate([carry, np.array(fresh, dtype=np.int64)])
        ranks = place(lengths, len(carry))
        out.append((lengths, ranks))
        carry = lengths[ranks < 0]
    return out


def evaluate(sample: Sampler, s: Setting, steps: int, seed: int) -> dict[str, dict[str, float]]:
    """Per model: time per real token of (a)-(d), and (a)'s row fullness."""
    packed = per_rank_packing(sample, s, steps, seed)
    slots = s.rows * s.seq_len
    cap = 2 * slots
    results = {}
    for model in MODELS:
        coeffs = PRESETS[model].cost_coeffs()
        cost = cost_function("attention", coeffs, ["x"])
        linear = coeffs[1]  # a padding token's cost (its attention term left out, see above)
        pad_cost = padding_cost(cost, PAD_TO)  # what the planner counts for it, as plan_budgets does

        def costs(lengths: np.ndarray, cost=cost) -> np.ndarray:
            return cost(lengths, np.zeros_like(lengths), np.zeros_like(lengths))

        base_time = sum(max(costs(L).sum() + linear * (slots - L.sum()) for L in step) for step in packed)
        base_tokens = sum(int(L.sum()) for step in packed for L in step)

        def fixed(lengths: np.ndarray, carried: int, costs=costs) -> np.ndarray:
            return assign(lengths, costs(lengths), carried, s.dp, s.rows, s.seq_len).rank

        def variable(lengths: np.ndarray, carried: int, costs=costs, pad_cost=pad_cost) -> np.ndarray:
            return assign_budgets(lengths, costs(lengths), carried, s.dp, cap, (), PAD_TO, pad_cost).rank

        figures = {"fullness": base_tokens / (steps * s.dp * slots), "a": base_time / base_tokens}
        for name, place in (("b", fixed), ("c", variable)):
            time_sum, tokens, ideal, tight, least = 0.0, 0, 0.0, 0.0, 1.0
            for lengths, ranks in global_steps(sample, s, steps, seed, place):
                c = costs(lengths)
                rank_cost = np.bincount(ranks[ranks >= 0], c[ranks >= 0], s.dp)
                rank_tokens = np.bincount(ranks[ranks >= 0], lengths[ranks >= 0], s.dp)
                width = [slots] * s.dp if name == "b" else [padded_length(int(n), PAD_TO, cap) for n in rank_tokens]
                time_sum += float((rank_cost + linear * (np.array(width) - rank_tokens)).max())
                tokens += int(rank_tokens.sum())
                least = min(least, rank_tokens.sum() / (s.dp * slots))
                ideal += max(float(rank_cost.sum()) / s.dp, float(c[ranks >= 0].max(initial=0.0)))
                tight += lower_bound(c[ranks >= 0], s.dp)
            figures[name] = time_sum / tokens
            if name == "c":
                figures["d"], figures["d_tight"] = ideal / tokens, tight / tokens
                figures["c_full"], figures["c_least"] = tokens / (steps * s.dp * slots), least
        results[model] = figures
    return results


def lower_bound(costs: np.ndarray, dp: int, depth: int = 4) -> float:
    """The least the most expensive of `dp` ranks can cost holding these segments: the mean,
    the largest segment, and for k = 1..depth the k+1 cheapest of the k*dp+1 most expensive
    segments (some rank holds k+1 of them). The issue's bound is the first two; the third
    matters where a step has a few more long segments than ranks."""
    by_cost = np.sort(costs)[::-1]
    found = [float(costs.sum()) / dp, float(by_cost[0]) if len(by_cost) else 0.0]
    found += [float(by_cost[k * dp - k : k * dp + 1].sum()) for k in range(1, depth + 1) if k * dp < len(by_cost)]
    return max(found)


def planner_time(sample: Sampler, steps: int, dp: int = 1024, seq_len: int = 32768, rows: int = 2) -> dict[str, float]:
    """--rank-tokens variable at dp=1024, 64k tokens a rank: the whole step plan over Segment
    objects, with the default document cap, as the coordinator runs it; and the assignment alone."""
    cost = cost_function("attention", PRESETS["llama-8b"].cost_coeffs(), ["x"])
    stream, none = Stream(sample, 11, seq_len), np.zeros(0, dtype=np.int32)
    plans, assigns, to_bound, segments = [], [], [], []
    for _ in range(steps):
        lengths = np.array(stream.take(dp * rows * seq_len), dtype=np.int64)
        fresh = [Segment(0, sample_id(0, i, 0), int(n), none, origin=(0, i)) for i, n in enumerate(lengths.tolist())]
        plan = None  # the last step's segments are freed here, not inside the timed plan (~3 ms at dp=1024)
        started = time.thread_time()  # CPU time: the wall clock of a shared machine says more about the others
        plan = plan_budgets(
            [], fresh, dp, 2 * rows * seq_len, cost, doc_cap=rows * seq_len // 4, plain=True, pad_to=PAD_TO
        )
        plans.append(time.thread_time() - started)
        c = cost(lengths, np.zeros_like(lengths), np.zeros_like(lengths))
        started = time.thread_time()
        assign_budgets(lengths, c, 0, dp, 2 * rows * seq_len)
        assigns.append(time.thread_time() - started)
        to_bound.append(plan.balance["to_bound"])
        segments.append(len(fresh))
    return {
        "plan_ms": 1000 * float(np.median(plans)),
        "assign_ms": 1000 * float(np.median(assigns)),
        "to_bound": float(np.mean(to_bound)),
        "segments": float(np.mean(segments)),
    }


def stepper_balance(
    steps: int,
    rank_tokens: str,
    dp: int = 4,
    seq_len: int = 4096,
    rows: int = 2,
    coeffs: str = "1,0,0",
    pad_to: int = 1,
) -> dict[str, float]:
    """The real Stepper, as a live coordinator runs it (shuffle window, mixture per segment,
    carry-over, document cap), over the bench corpus's three sources in reading order; by
    default with a quadratic cost (1,0,0): the setting of issue 25's fixed-row figure. Mean
    over steps of the max rank cost over the issue's lower bound, and over the bound with
    the pigeonhole terms (lower_bound())."""
    lengths, _, source = corpus_lengths()
    spec = Spec.from_dict(
        {
            "sources": [{"name": n, "path": "x", "weight": w} for n, w in _QUALITY_WEIGHTS.items()],
            **{"seq_len": seq_len, "rows": rows, "cost_coeffs": coeffs, "rank_tokens": rank_tokens, "pad_to": pad_to},
        }
    )
    cost = cost_function("attention", tuple(float(c) for c in coeffs.split(",")), ["x"])
    by_source = [lengths[source == i] for i in range(3)]
    intakes = [MemoryIntake(i, len(n), lambda p, n=n: np.zeros(n[p], dtype=np.int32)) for i, n in enumerate(by_source)]
    stepper = Stepper(spec, intakes)  # type: ignore[arg-type]  (the intake's interface, in memory)
    stepper.dp = dp
    to_bound, to_tight, carried = [], [], []
    for _ in range(steps):
        step = stepper.next_step()
        if step is None:
            break
        real = [
            n
            for batch in step.batches
            for n, src in zip(np.diff(batch["cu_seqlens"]).tolist(), batch["source"].tolist())
            if src >= 0
        ]
        costs = cost(np.array(real, dtype=np.int64), np.zeros(len(real)), np.zeros(len(real)))
        worst = max(step.balance["rank_cost"])
        to_bound.append(step.balance["to_bound"])
        to_tight.append(worst / lower_bound(costs, dp))
        carried.append(step.balance["carried"])
    return {
        "to_bound": float(np.mean(to_bound)),
        "to_tight": float(np.mean(to_tight)),
        "carried": float(np.mean(carried)),
    }


def _met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def balance_figures(args: argparse.Namespace, settings: list[dict], stepper: list[dict], planner: list[dict]) -> list:
    """The summary table's rows: the share over all settings (the documented settings under
    the row's own text, others naming theirs), the live balance at dp 8 and the planner's time."""
    figures = []
    if settings:
        shares = [r["share_variable"] for r in settings]
        where = ""
        if (args.lengths, args.seqs, args.dps) != ("corpus,long-tail", "4096,8192,32768,131072", "8,64"):
            where = f", lengths {args.lengths}, seq_len {args.seqs}, dp {args.dps}"
        figures.append(
            Figure(
                f"variable token budgets, share of the possible gain over per-rank packing{where} (≥ 95%)",
                f"{100 * min(shares):.1f}-{100 * max(shares):.1f}% in all {len(shares)} settings: "
                + _met(min(shares) >= 0.95),
                "per-rank packing",
            )
        )
    live = {r["rank_tokens"]: r["to_bound"] for r in stepper if r["dp"] == 8}
    if live:
        figures.append(
            Figure(
                "live balance / lower bound, dp 8, 8192 × 2 (variable ≤ 1.02, fixed ≤ 1.05)",
                f"{live['variable']:.3f}, {live['fixed']:.3f} (mean of {args.stepper_steps} steps): "
                + _met(live["variable"] <= 1.02 and live["fixed"] <= 1.05),
            )
        )
    if planner:
        ms = sorted(r["plan_ms"] for r in planner)
        figures.append(
            Figure(
                f"planner CPU a step, variable budgets, dp {args.large_dp:,}, 64k-token ranks (≤ 10 ms)",
                f"{ms[0]:.1f}-{ms[-1]:.1f} ms ({', '.join(r['lengths'] for r in planner)}; median of "
                f"{args.large_steps} steps each): {_met(ms[-1] <= 10)}",
            )
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps simulated per setting")
    parser.add_argument("--lengths", default="corpus,long-tail")
    parser.add_argument("--seqs", default="4096,8192,32768,131072")
    parser.add_argument("--dps", default="8,64")
    parser.add_argument("--large-dp", type=int, default=1024)
    parser.add_argument("--large-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stepper-steps", type=int, default=300, help="steps of the real Stepper (0: none)")
    add_json_flag(parser)
    args = parser.parse_args()
    samplers: dict[str, Sampler] = {}
    for name in args.lengths.split(","):
        samplers[name] = corpus_sampler() if name == "corpus" else long_tail
    print(
        f"commit {commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.steps} steps a setting, "
        f"rows = max(1, {RANK_TOKENS} // seq_len), variable cap 2 x rows x seq_len, pad {PAD_TO}"
    )
    print(
        "gain: time per real token of (a) per-rank packing over that of (b) fixed rows, (c) variable budgets, "
        "(d) ideal;\nshare = (gain - 1) / (ideal - 1), the ideal each step's lower bound: max(mean rank cost, "
        "largest segment)\n(the issue's), and in the last column with the pigeonhole terms (lower_bound())"
    )
    head = f"{'lengths':<10}{'seq':>7}{'rows':>5}{'dp':>4} {'model':<10}{'(a) full':>9}"
    head += f"{'fixed':>7}{'variable':>9}{'ideal':>7}{'share fixed':>12}{'share var':>10}{'var, tight':>11}"
    print(head + f"{'var full':>9}")
    worst, worst_tight, least = 1.0, 1.0, 1.0
    settings: list[dict] = []
    for lengths_name, sample in samplers.items():
        for seq_len in map(int, args.seqs.split(",")):
            for dp in map(int, args.dps.split(",")):
                s = Setting(seq_len, max(1, RANK_TOKENS // seq_len), dp)
                for model, f in evaluate(sample, s, args.steps, args.seed).items():
                    gain = {k: f["a"] / f[k] for k in ("b", "c", "d", "d_tight")}
                    share = {k: (gain[k] - 1) / (gain["d"] - 1) for k in "bc"}
                    tight = (gain["c"] - 1) / (gain["d_tight"] - 1)
                    worst, worst_tight = min(worst, share["c"]), min(worst_tight, tight)
                    least = min(least, f["c_least"])
                    settings.append(
                        {"lengths": lengths_name, "seq_len": seq_len, "rows": s.rows, "dp": dp, "model": model}
                        | {"packed_full": f["fullness"], "variable_full": f["c_full"], "variable_least": f["c_least"]}
                        | {f"gain_{n}": gain[k] for n, k in (("fixed", "b"), ("variable", "c"), ("ideal", "d"))}
                        | {"share_fixed": share["b"], "share_variable": share["c"], "share_variable_tight": tight}
                    )
                    print(
                        f"{lengths_name:<10}{seq_len:>7}{s.rows:>5}{dp:>4} {model:<10}{f['fullness']:>9.1%}"
                        f"{gain['b']:>7.3f}{gain['c']:>9.3f}{gain['d']:>7.3f}{share['b']:>12.1%}{share['c']:>10.1%}"
                        f"{tight:>11.1%}{f['c_full']:>9.1%}"
                    )
    print(f"variable budgets, least share of the possible improvement: {worst:.1%} (tight bound: {worst_tight:.1%})")
    print(f"variable budgets, least full step: {least:.1%} of dp x rows x seq_len real tokens")
    stepper: list[dict] = []
    if args.stepper_steps:
        llama_8b = ",".join(str(c) for c in PRESETS["llama-8b"].cost_coeffs())
        for mode, (dp, seq_len, rows, coeffs, pad, cost_name) in itertools.product(
            ("fixed", "variable"), ((4, 4096, 2, "1,0,0", 1, "len^2"), (8, 8192, 2, llama_8b, PAD_TO, "llama-8b"))
        ):
            f = stepper_balance(args.stepper_steps, mode, dp, seq_len, rows, coeffs, pad)
            stepper.append({"rank_tokens": mode, "dp": dp, "seq_len": seq_len, "rows": rows, "cost": cost_name} | f)
            print(
                f"real Stepper, bench corpus, dp={dp}, {seq_len} x {rows}, cost {cost_name}, pad {pad}, "
                f"--rank-tokens {mode}: max rank cost / lower bound {f['to_bound']:.3f}, / bound with pigeonhole "
                f"terms {f['to_tight']:.3f} (mean of {args.stepper_steps} steps; {f['carried']:.1f} segments "
                "carried a step)"
            )
    planner: list[dict] = []
    for lengths_name, sample in samplers.items():
        big = planner_time(sample, args.large_steps, args.large_dp)
        planner.append({"lengths": lengths_name, "dp": args.large_dp} | big)
        print(
            f"planner at dp={args.large_dp}, 64k-token ranks, {lengths_name} ({big['segments']:.0f} segments a step, "
            f"llama-8b), CPU time a step: whole step plan {big['plan_ms']:.1f} ms, assignment alone "
            f"{big['assign_ms']:.1f} ms (median of {args.large_steps}); max / lower bound {big['to_bound']:.4f}"
        )
    figures = balance_figures(args, settings, stepper, planner)
    raw = {"steps": args.steps, "stepper_steps": args.stepper_steps, "large_steps": args.large_steps}
    write_results(args.json, figures, raw | {"settings": settings, "stepper": stepper, "planner": planner})


if __name__ == "__main__":
    main()
