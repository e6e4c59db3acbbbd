"""Batches into a GPU: the rank client's three ways of handing a batch to the training step.

One rank consumes --steps batches of a served job (byte tokenizer, 3 generated sources), once
per way, each on a fresh job with the same spec, so every way gets the same batches:

- `plain + .to()`: CPU tensors that the trainer copies with `.to("cuda")` (from pageable
  memory, so the copy is synchronous), what a script does without the options;
- `pin_memory`: tensors in page-locked memory, copied with `.to("cuda", non_blocking=True)`;
- `device=`: `omniload.connect(device="cuda")`, the batch already queued onto the GPU.

With --compute-ms the step also runs that long of GPU matrix products (a stand-in for the
model), so the figure says whether the copy hides behind the compute or adds to the step.
Each way's batches are checked on the GPU against the first way's (a weighted sum of every
step's input_ids and labels): a way that hands out other bytes fails the run.

    python -m scripts.bench_device [--steps 200] [--seq-len 8192] [--rows 8] [--compute-ms 0,20]

Needs CUDA. What it does not show: NCCL (one rank; see scripts/gpu_check.sh for a torchrun
training over NCCL), several GPUs sharing a host's PCIe lanes, or a real model's memory traffic.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from scripts.harness import Figure, add_json_flag, write_results

WAYS = ("plain + .to()", "pin_memory", "device=")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _busy(ms: float, device: str) -> Callable[[], object]:
    """A step of about `ms` milliseconds of bf16 matrix products on the device (0: none)."""
    if ms <= 0:
        return lambda: None
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(5):  # the first products load the kernels: timed, they would shrink the step
        a @ a
    _sync(device)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    _sync(device)
    per = (time.perf_counter() - start) / 20
    times = max(1, round(ms / 1000 / per))
    return lambda: [a @ a for _ in range(times)]


def alone(busy: Callable[[], object], steps: int, device: str) -> float:
    """Seconds for the steps' compute with no loader: what the step would take with free data."""
    busy()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        busy()
    _sync(device)
    return time.perf_counter() - start


def consume(spec: dict, way: str, steps: int, busy: Callable[[], object], device: str) -> tuple[float, int, int, int]:
    """(seconds for the steps after the first, tokens a step, bytes a step, checksum of the batches)."""
    import omniload

    options = {"pin_memory": True} if way == "pin_memory" else {"device": device} if way == "device=" else {}
    with omniload.Job({**spec, "steps": steps + 1}) as job:
        loader = omniload.connect(job.addr, job.token, rank=0, world_size=1, **options)
        weights, total, start, nbytes = None, torch.zeros((), dtype=torch.int64, device=device), 0.0, 0
        for batch in loader:
            if way != "device=":  # every tensor of the batch, as device= moves them all
                batch = {name: t.to(device, non_blocking=True) for name, t in batch.items()}
            ids, labels = batch["input_ids"], batch["labels"]
            if weights is None:  # the first batch: the job's start is not timed
                weights = torch.arange(1, ids.numel() + 1, device=device, dtype=torch.int64).view(ids.shape)
                nbytes = sum(t.numel() * t.element_size() for t in batch.values())
                _sync(device)
                start = time.perf_counter()
            total += (ids.to(torch.int64) * weights).sum() + (labels.to(torch.int64) * weights).sum() * 3
            busy()
        _sync(device)
        seconds = time.perf_counter() - start
        loader.close()
    return seconds, ids.numel(), nbytes, int(total)


def main() -> None:
    from scripts.bench_data import make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--compute-ms", default="0,20", help="GPU work per step, one pass over the ways each")
    parser.add_argument("--device", default="cuda", help="cpu: run the script's own code without a GPU")
    parser.add_argument("--docs", type=int, default=20000, help="documents per source")
    add_json_flag(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_device.py needs CUDA: torch.cuda.is_available() is False here (or pass --device cpu)")
    spec = {
        "sources": make_sources(3, args.docs),
        "seq_len": args.seq_len,
        "rows": args.rows,
        "seed": 0,
        "epochs": 0,
    }
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{name}, torch {torch.__version__}; 1 rank, seq_len {args.seq_len} x rows "
        f"{args.rows}, {args.steps} timed steps a way"
    )
    print(f"{'compute/step':>13}{'way':>16}{'step ms':>9}{'tokens/s':>14}{'GB/s in':>9}")
    passes: list[dict] = []  # a pass over the ways a --compute-ms, for --json
    for compute_ms in (float(ms) for ms in args.compute_ms.split(",")):
        busy = _busy(compute_ms, args.device)
        passes.append({"compute_ms": compute_ms, "alone_step_ms": None, "ways": {}})
        if compute_ms > 0:
            step = alone(busy, args.steps, args.device) / args.steps
            passes[-1]["alone_step_ms"] = step * 1000
            print(f"{compute_ms:>11.0f}ms{'compute alone':>16}{step * 1000:>9.1f}", flush=True)
        sums = set()
        for way in WAYS:
            seconds, tokens, nbytes, checksum = consume(spec, way, args.steps, busy, args.device)
            sums.add(checksum)
            step = seconds / args.steps
            gb = nbytes / step / 1e9
            passes[-1]["ways"][way] = {"step_ms": step * 1000, "tokens_per_s": tokens / step, "gb_per_s": gb}
            print(f"{compute_ms:>11.0f}ms{way:>16}{step * 1000:>9.1f}{tokens / step:>14,.0f}{gb:>9.2f}", flush=True)
        if len(sums) != 1:
            raise SystemExit(f"the ways handed out different batches (checksums {sorted(sums)})")
    print("every way handed out the same batches (checksum of input_ids and labels on the device)")
    write_results(
        args.json,
        [_figure(one, args.seq_len * args.rows, args.device) for one in passes],
        {"device": name, "steps": args.steps, "seq_len": args.seq_len, "rows": args.rows, "passes": passes},
    )


def _figure(one: dict, tokens: int, device: str) -> Figure:
    """A pass's summary row: with compute, what each way adds to the compute alone; without, each
    way's step."""
    size = f"{tokens // 1000}k" if tokens >= 1000 else f"{tokens}"
    on = "GPU" if device == "cuda" else device.upper()
    ways = one["ways"]
    if one["alone_step_ms"] is None:
        return Figure(
            f"a batch into the {on} with no compute, {size} tokens, ms a step",
            ", ".join(f"{way} {w['step_ms']:.2f}" for way, w in ways.items()),
        )
    alone = one["alone_step_ms"]
    added = [w["step_ms"] - alone for w in ways.values()]
    return Figure(
        f"the loader's cost in a {on} step of {one['compute_ms']:g} ms of compute, {size} tokens",
        f"{min(added):+.1f} to {max(added):+.1f} ms ({max(added) / alone:.0%} at most) on a {alone:.1f} ms step: "
        + ", ".join(f"{way} {a:+.1f}" for way, a in zip(ways, added)),
        "the compute alone",
    )


if __name__ == "__main__":
    main()
