"""Delivered tokens/s with one source ten times costlier per token: autoscaled vs static split.

Same files, same transforms, same budget of worker processes on both sides: `static` is
`--workers B` (split by weight once, so the costly source gets what its weight says);
`auto` is `--workers auto` with `--reserve-cpus` set so that its budget is the same B, and
the split follows each source's measured cost. K sources of equal weight; every source's
transform does the same per-token work (a few rounds of integer arithmetic over its byte
tokens), the first source ten times as many rounds. One rank consumes as fast as it can;
the figure is delivered tokens/s over the timed window (from the job's status), and the
split (workers per source) is sampled every second to show how it moved.

Trials alternate the two sides (static first in odd trials, auto first in even ones, so a
drift of the machine hits both alike); the result is each side's median over the trials and
the ratio of the medians. Each run also reports where the CPU went over its timed window
(coordinator with its threads, workers, the rank, other helpers such as senders), which is
what bounds the ratio on a machine with few cores: a static split leaves the costly source's
worker busy and the others idle, and the idle CPU goes to the coordinator and the rank;
a balanced split keeps every worker busy, so the coordinator and the rank compete with them.

    python -m scripts.bench_autoscale [--budget 2] [--sources 4] [--seconds 30] [--trials 3]

With --shift, the cost moves during the run instead: every source starts cheap, source s0
becomes ten times costlier after --warmup seconds, and cheap again --seconds later while s1
takes its place for another --seconds. The tokens are the same in every phase (the transform
only works harder), so both sides deliver the same batches. Each run reports tokens/s per
phase, the autoscaler's moves with the time of each and delivery in the 3 s before and after
it, and how long after a shift the split first moved.

    python -m scripts.bench_autoscale --shift [--budget 2] [--seconds 30] [--trials 3]

What a machine with few cores can show: a split decides how many cores a source's work may
use, so it shows only where workers are not time-shared. With OMNILOAD_CPUS=8 on 2 cores the
8 workers share 2 cores, whatever the split, and the figure measures CPU per token (auto's
extra lanes cost some); at 40 rounds both sides are bound by the coordinator as well.
--sleep-ns makes most of each transform's cost a wait, so every worker runs as if on a core
of its own: then the split is what bounds delivery, as on a machine with a core per worker
(what it still does not show: the coordinator and rank competing with busy workers).

    OMNILOAD_CPUS=8 python -m scripts.bench_autoscale --shift --sources 8 --budget 8 --sleep-ns 100 --ring-mb 1
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import numpy as np
import psutil

from scripts.harness import Figure, add_json_flag, children_import_scripts, write_results

children_import_scripts()  # workers import this module's tokenizers, ranks its loaders

_ROUNDS_ENV = "OMNILOAD_BENCH_ROUNDS"
_ROUNDS = int(os.environ.get(_ROUNDS_ENV, "40"))  # a cheap source's per-token work; the costly one does 10x
_SLEEP_ENV = "OMNILOAD_BENCH_SLEEP_NS"  # --sleep-ns: a round's wall time per token, on top of its CPU work


def _work(text: str, rounds: int) -> np.ndarray:
    tokens = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    mixed = tokens.copy()
    for _ in range(rounds):  # per-token CPU work that cannot be skipped
        mixed = (mixed * 1103515245 + 12345) & 0x7FFFFFFF
    sleep_ns = int(os.environ.get(_SLEEP_ENV, "0"))
    if sleep_ns:  # a worker busy without taking one of this machine's few cores (see --sleep-ns)
        time.sleep(rounds * len(tokens) * sleep_ns * 1e-9)
    return tokens if mixed.sum() >= 0 else mixed


def cheap(text: str) -> np.ndarray:
    return _work(text, _ROUNDS)


def costly(text: str) -> np.ndarray:
    return _work(text, 10 * _ROUNDS)


_PHASE_ENV = "OMNILOAD_BENCH_PHASE_FILE"  # holds the name of the costly source (empty: none)
_PHASE_CHECK_S = 0.25
_phase = {"checked": 0.0, "costly": ""}


def _costly_now() -> str:
    now = time.monotonic()
    if now - _phase["checked"] > _PHASE_CHECK_S:
        _phase["checked"] = now
        with contextlib.suppress(OSError):
            _phase["costly"] = Path(os.environ[_PHASE_ENV]).read_text().strip()
    return str(_phase["costly"])


def __getattr__(name: str):  # noqa: ANN202  (tokenizer "scripts.bench_autoscale:shifting_s0" and so on)
    """The transform of source NAME under --shift: ten times the work while NAME is the costly one."""
    if not name.startswith("shifting_"):
        raise AttributeError(name)
    source = name[len("shifting_") :]
    return lambda text: _work(text, 10 * _ROUNDS if _costly_now() == source else _ROUNDS)


def _rank(addr: str, token: str) -> None:
    import omniload

    for _ in omniload.connect(addr, token, rank=0, world_size=1):
        pass


def _cpu_by_role(coordinator: int, rank: int) -> dict[str, float]:
    """CPU seconds so far of the job's live processes by role (a worker stopped by a re-split
    takes its seconds with it: the workers' figure is a lower bound after a move)."""
    out = {"coordinator": 0.0, "workers": 0.0, "rank": 0.0, "helpers": 0.0}

    def seconds(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    with contextlib.suppress(psutil.Error):
        out["rank"] = seconds(psutil.Process(rank))
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(coordinator)
        out["coordinator"] = seconds(root)
        for child in root.children():
            with contextlib.suppress(psutil.Error):
                if "forkserver" in " ".join(child.cmdline()):
                    out["helpers"] += seconds(child)
                    for worker in child.children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            out["workers"] += seconds(worker)
                else:  # resource tracker, senders
                    out["helpers"] += seconds(child)
    return out


def run(spec_dict: dict, seconds: float, warmup: float) -> dict:
    """Delivered tokens/s over `seconds` after `warmup`, the split sampled each second, the
    autoscaler's moves and measured costs, and the CPU (in cores) by role over the window."""
    import omniload

    job = omniload.Job(spec_dict).start()
    rank = multiprocessing.get_context("spawn").Process(target=_rank, args=(job.addr, job.token), daemon=True)
    rank.start()
    splits: list[str] = []
    try:
        started = time.monotonic()
        first = None
        while (now := time.monotonic()) < started + warmup + seconds:
            time.sleep(1.0)
            status = job.status()
            split = "/".join(str(s["workers"]) for s in status["sources"])
            if not splits or splits[-1].split(" ", 1)[1] != split:
                splits.append(f"{now - started:.0f}s {split}")
            if first is None and now - started >= warmup:
                first = (time.monotonic(), status["delivered"]["tokens"], _cpu_by_role(job._process.pid, rank.pid))
        status = job.status()
        last = (time.monotonic(), status["delivered"]["tokens"], _cpu_by_role(job._process.pid, rank.pid))
    finally:
        rank.kill()
        rank.join()
        job.stop()
    elapsed = last[0] - first[0]
    return {
        "tokens_per_s": (last[1] - first[1]) / elapsed,
        "splits": splits,
        "moves": status["workers"]["moves"],
        "coordinator_mb": status["memory_mb"]["coordinator"],
        "costs": [s["cpu_us_per_ktoken"] for s in status["sources"]],
        "cores": {role: max(0.0, last[2][role] - first[2][role]) / elapsed for role in last[2]},
    }


def run_shifting(spec_dict: dict, phases: list[tuple[str, float]], phase_file: Path) -> dict:
    """Delivered tokens/s in each phase (name of the costly source, seconds), the split each
    second, and the moves with their times; the first phase is the warm-up."""
    import omniload

    phase_file.write_text("")
    job = omniload.Job(spec_dict).start()
    rank = multiprocessing.get_context("spawn").Process(target=_rank, args=(job.addr, job.token), daemon=True)
    rank.start()
    splits: list[str] = []
    moves: list[tuple[float, int]] = []
    delivered: list[tuple[float, int]] = []  # (seconds since start, tokens) at each phase's end
    series: list[tuple[float, int]] = []  # (seconds since start, tokens) each second
    try:
        started = time.monotonic()
        for costly_source, seconds in phases:
            phase_file.write_text(costly_source)
            end = time.monotonic() + seconds
            while (now := time.monotonic()) < end:
                time.sleep(min(1.0, max(0.0, end - now)))
                status = job.status()
                at = time.monotonic() - started
                series.append((at, status["delivered"]["tokens"]))
                split = "/".join(str(s["workers"]) for s in status["sources"])
                if not splits or splits[-1].split(" ", 1)[1] != split:
                    splits.append(f"{at:.0f}s {split}")
                if status["workers"]["moves"] > (moves[-1][1] if moves else 0):
                    moves.append((at, status["workers"]["moves"]))
            delivered.append((time.monotonic() - started, job.status()["delivered"]["tokens"]))
    finally:
        rank.kill()
        rank.join()
        job.stop()
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(delivered, delivered[1:])]
    shifts = [end for end, _ in delivered[:-1]]  # when each timed phase began
    first_move = [next((round(t - shift, 1) for t, _ in moves if t >= shift), None) for shift in shifts]
    # a move happened within the second before the sample that saw it: delivery over the 3 s
    # before that second against the 3 s from it on shows whether the move stalled delivery
    around = [(_rate(series, t - 4, t - 1), _rate(series, t - 1, t + 2)) for t, _ in moves]
    return {"rates": rates, "splits": splits, "moves": moves, "first_move": first_move, "around": around}


def _rate(series: list[tuple[float, int]], start: float, end: float) -> float:
    """Tokens/s between the samples nearest `start` and `end`."""
    a = min(series, key=lambda sample: abs(sample[0] - start))
    b = min(series, key=lambda sample: abs(sample[0] - end))
    return (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0


def _sides(sources: list[dict], args: argparse.Namespace, cpus: int) -> dict[str, dict]:
    """The two specs compared, the same but for the split: static by weight, or autoscaled
    with the same budget of workers."""
    base = {
        "sources": sources,
        "seq_len": 2048,
        "rows": 4,
        "seed": 0,
        "epochs": 0,
        "ring_mb": args.ring_mb,
        "shuffle_window": args.shuffle_window,
        "shard_interleave": args.shard_interleave,
    }
    return {
        "static": dict(base, workers=args.budget),
        "auto": dict(base, workers="auto", reserve_cpus=cpus - args.budget, autoscale_every=args.every),
    }


def main_shift(args: argparse.Namespace, cpus: int) -> tuple[list[Figure], dict]:
    import tempfile

    from scripts.bench_data import make_sources

    phase_file = Path(tempfile.mkdtemp(prefix="omniload-bench-")) / "costly"
    os.environ[_PHASE_ENV] = str(phase_file)
    sources = make_sources(args.sources, args.docs)
    for source in sources:
        source["tokenizer"] = f"scripts.bench_autoscale:shifting_{source['name']}"
    sides = _sides(sources, args, cpus)
    phases = [("", args.warmup), ("s0", args.seconds), ("s1", args.seconds)]
    print(
        f"machine: {_cores(cpus)}; {args.sources} sources of equal weight, all cheap ({args.rounds} rounds per "
        f"token{_sleeping(args)}) for {args.warmup:.0f}s, then s0 ten times costlier for {args.seconds:.0f}s, "
        f"then s1 instead for {args.seconds:.0f}s; {args.budget} worker processes on each side "
        f"(auto: --autoscale-every {args.every:g}); one rank as fast as it can; {args.trials} trials alternating"
    )
    print(
        f"{'trial':<6}{'side':<8}{'s0 costly':>11}{'s1 costly':>11}  first move after shift; moves at (tokens/s "
        "in the 3 s before -> the 3 s from it); split over time"
    )
    results: dict[str, list[list[float]]] = {"static": [], "auto": []}
    runs = []
    for trial in range(1, args.trials + 1):
        for side in ("static", "auto") if trial % 2 else ("auto", "static"):
            r = run_shifting(sides[side], phases, phase_file)
            results[side].append(r["rates"])
            runs.append({"trial": trial, "side": side, "tokens_per_s": dict(zip(("s0", "s1"), r["rates"]))})
            runs[-1] |= {k: r[k] for k in ("splits", "moves", "first_move", "around")}
            around = zip(r["moves"], r["around"])
            moves = ", ".join(f"{t:.0f}s ({a / 1e3:,.0f}k -> {b / 1e3:,.0f}k)" for (t, _), (a, b) in around) or "none"
            first = "/".join("-" if m is None else f"{m:.0f}s" for m in r["first_move"])
            print(
                f"{trial:<6}{side:<8}{r['rates'][0]:>11,.0f}{r['rates'][1]:>11,.0f}  {first}; moves at {moves}; "
                f"{', '.join(r['splits'])}",
                flush=True,
            )
    medians, ratios = [], []
    for phase, name in enumerate(("s0 costly", "s1 costly")):
        static = statistics.median(r[phase] for r in results["static"])
        auto = statistics.median(r[phase] for r in results["auto"])
        per_trial = ", ".join(f"{a[phase] / s[phase]:.2f}x" for s, a in zip(results["static"], results["auto"]))
        medians.append(auto / static)
        ratios += [a[phase] / s[phase] for s, a in zip(results["static"], results["auto"])]
        print(
            f"{name}: median tokens/s static {static:,.0f}, auto {auto:,.0f}; auto / static {auto / static:.2f}x "
            f"(per trial: {per_trial})"
        )
    simulated = " simulated" if args.sleep_ns else ""
    figure = Figure(
        f"autoscaling under a cost shift, {args.budget} workers{simulated} (≥ 1.5x)",
        f"{medians[0]:.2f}x, {medians[1]:.2f}x at the median ({len(ratios)} phases {min(ratios):.2f}-"
        f"{max(ratios):.2f}x): {'**met**' if min(medians) >= 1.5 else '**missed**'}",
        "static split",
    )
    return [figure], {"shift": True, "cpus": cpus, "budget": args.budget, "sleep_ns": args.sleep_ns, "runs": runs}


def _cores(cpus: int) -> str:
    here = len(os.sched_getaffinity(0))
    return f"{cpus} cores" if cpus == here else f"{cpus} cores by OMNILOAD_CPUS ({here} here, time-shared)"


def _sleeping(args: argparse.Namespace) -> str:
    return f", each also waiting {args.sleep_ns} ns per token: a core per worker simulated" if args.sleep_ns else ""


def main() -> None:
    from scripts.bench_data import make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=2, help="worker processes on each side (at most the cores)")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="timed window per run")
    parser.add_argument(
        "--warmup", type=float, default=15.0, help="seconds before the window (auto measures, then moves)"
    )
    parser.add_argument("--every", type=float, default=3.0, help="auto: --autoscale-every")
    parser.add_argument("--trials", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument(
        "--rounds",
        type=int,
        default=_ROUNDS,
        help="a cheap source's per-token work (the costly source does ten times as many rounds)",
    )
    parser.add_argument("--docs", type=int, default=20000, help="documents per source")
    parser.add_argument("--shift", action="store_true", help="the costly source changes during the run (see above)")
    parser.add_argument(
        "--sleep-ns",
        type=int,
        default=0,
        help="each round of a transform also waits this many ns per token (0: off): with most of "
        "the cost a wait, every worker runs as if on a core of its own, which shows what the split does "
        "for a machine with a core per worker when this one has fewer; the CPU rounds stay, in the same "
        "ratio, for the autoscaler to measure",
    )
    parser.add_argument(
        "--ring-mb",
        type=int,
        default=4,
        help="both sides (the job default is 4): a lane works "
        "ahead through its source's other lanes' turns only as far as its ring holds",
    )
    parser.add_argument(
        "--shuffle-window",
        type=int,
        default=512,
        help="both sides (segments; 0: the job "
        "default, 8M tokens). The planner fills a source's share of it before the first draw: "
        "with costlier transforms (--rounds 160) the default window is still filling when the "
        "timed window ends, and both sides measure the fill (0.99x). 512 segments fill in the "
        "warm-up at any of these costs",
    )
    parser.add_argument(
        "--shard-interleave", type=int, default=4, help="both sides: row groups read together (the job default is 4)"
    )
    add_json_flag(parser)
    args = parser.parse_args()
    from omniload.coordinator.pool.worker_pool import available_cpus

    cpus = available_cpus()  # OMNILOAD_CPUS=N: measure the split of a larger machine (time-shared here)
    if not 1 <= args.budget <= cpus:
        parser.error(
            f"--budget must be 1..{cpus} (the cores here, or OMNILOAD_CPUS): auto's budget is the cores less "
            "--reserve-cpus"
        )
    os.environ[_ROUNDS_ENV] = str(args.rounds)  # the workers' transforms read them
    os.environ[_SLEEP_ENV] = str(args.sleep_ns)
    if args.shift:
        write_results(args.json, *main_shift(args, cpus))
        return

    sources = make_sources(args.sources, args.docs)
    for i, source in enumerate(sources):
        source["tokenizer"] = "scripts.bench_autoscale:costly" if i == 0 else "scripts.bench_autoscale:cheap"
    sides = _sides(sources, args, cpus)
    print(
        f"machine: {cpus} cores; {args.sources} sources of equal weight, source s0 ten times costlier per token "
        f"({args.rounds} rounds per token for the others); --ring-mb {args.ring_mb}; "
        f"--shuffle-window {args.shuffle_window}; "
        f"{args.budget} worker processes on each side; one rank "
        f"as fast as it can; {args.warmup:.0f}s warm-up, {args.seconds:.0f}s timed; {args.trials} trials alternating"
    )
    names = "/".join(s["name"] for s in sources)
    print(
        f"{'trial':<6}{'side':<8}{'tokens/s':>11}  {'cores: coord':>12}{'workers':>8}{'rank':>6}{'other':>6}"
        f"{'moves':>6}  workers per source ({names}) over time; cost CPU us/1000 tokens"
    )
    results: dict[str, list[float]] = {"static": [], "auto": []}
    runs = []
    for trial in range(1, args.trials + 1):
        for side in ("static", "auto") if trial % 2 else ("auto", "static"):
            r = run(sides[side], args.seconds, args.warmup)
            results[side].append(r["tokens_per_s"])
            runs.append({"trial": trial, "side": side} | r)
            c = r["cores"]
            costs = (
                "" if side == "static" else "; cost " + "/".join("-" if x is None else f"{x:.0f}" for x in r["costs"])
            )
            print(
                f"{trial:<6}{side:<8}{r['tokens_per_s']:>11,.0f}  {c['coordinator']:>12.2f}{c['workers']:>8.2f}"
                f"{c['rank']:>6.2f}{c['helpers']:>6.2f}{r['moves']:>6}  {', '.join(r['splits'])}{costs}",
                flush=True,
            )
    static, auto = statistics.median(results["static"]), statistics.median(results["auto"])
    print(
        f"median tokens/s: static {static:,.0f}, auto {auto:,.0f}; autoscaled / static: {auto / static:.2f}x "
        f"(per trial: {', '.join(f'{a / s:.2f}x' for s, a in zip(results['static'], results['auto']))})"
    )
    ratios = [a / s for s, a in zip(results["static"], results["auto"])]
    figure = Figure(
        f"autoscaled / static tokens/s, one source of {args.sources} ten times costlier, {args.budget} workers"
        f"{' simulated' if args.sleep_ns else ''}",
        f"{auto / static:.2f}x at the median ({len(ratios)} trials {min(ratios):.2f}-{max(ratios):.2f}x)",
        "static split",
    )
    write_results(args.json, [figure], {"shift": False, "cpus": cpus, "budget": args.budget, "runs": runs})


if __name__ == "__main__":
    main()
