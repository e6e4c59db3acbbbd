"""Chaos runs too long for the test suite (short versions: tests/integration/test_chaos.py).

python -m scripts.chaos workers [--kills 100] [--steps 1500]
    Ranks train through a run in which random workers are SIGKILLed; prints whether every
    rank saw exactly the batches of an undisturbed run, the longest a rank waited for a
    batch (with and without kills), and the restarts the coordinator logged.
python -m scripts.chaos throttle [--seconds 60] [--every 5]
    Ranks read a corpus from an S3 endpoint (moto's server on loopback) through a proxy that
    answers 503 SlowDown to one connection in --every, for --seconds of training; prints whether
    every rank saw exactly the batches of an unthrottled run and how many requests were refused.
python -m scripts.chaos fuzz [--rounds 200] [--idle 500]
    Bad connections (random bytes, truncated frames, huge lengths, wrong token and
    version, duplicate HELLOs, ACKs for steps never sent) beside good ranks; prints
    whether the good ranks were disturbed, the coordinator's crashes and memory growth.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import random
import signal
import socket
import time
from pathlib import Path

import psutil


def _rank(addr: str, token: str, rank: int, world: int, step_s: float, conn) -> None:
    import omniload

    loader = omniload.connect(addr, token, rank=rank, world_size=world)
    hashes, waits, waited = [], [], 0.0
    for batch in loader:
        waits.append(loader.wait_seconds - waited)
        waited = loader.wait_seconds
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(batch):
            digest.update(name.encode() + batch[name].numpy().tobytes())
        hashes.append(digest.hexdigest())
        time.sleep(step_s)
    loader.close()
    conn.send((hashes, waits))


def _run(job, world: int, step_s: float, during=None) -> list[tuple[list[str], list[float]]]:
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    ranks = [ctx.Process(target=_rank, args=(job.addr, job.token, r, world, step_s, pipes[r][1])) for r in range(world)]
    for process in ranks:
        process.start()
    if during:
        during(job)
    results = [receive.recv() for receive, _ in pipes]
    for process in ranks:
        process.join()
    return results


def _workers(job) -> list[psutil.Process]:
    coordinator = psutil.Process(job._process.pid)
    return [w for server in coordinator.children() for w in server.children() if w.status() != psutil.STATUS_ZOMBIE]


def chaos_workers(kills: int, steps: int, world: int, step_s: float) -> None:
    import omniload
    from scripts.bench_data import make_sources

    spec = {
        "sources": make_sources(4, 4000),
        "seq_len": 512,
        "rows": 2,
        "workers": 4,
        "seed": 1,
        "epochs": 0,
        "steps": steps,
        "max_restarts": kills,
        "ring_mb": 1,
    }
    with omniload.Job(spec) as job:
        calm = _run(job, world, step_s)
    rng = random.Random(0)
    done = []

    def kill_workers(job) -> None:
        time.sleep(1.0)
        gap = steps * step_s / (kills + 2)
        for _ in range(kills):
            time.sleep(rng.uniform(0.5, 1.5) * gap)
            while not (alive := _workers(job)):
                time.sleep(0.01)
            victim = rng.choice(alive)
            victim.send_signal(signal.SIGKILL)
            psutil.wait_procs([victim], timeout=5)
            done.append(victim.pid)

    started = time.monotonic()
    with omniload.Job(spec) as job:
        chaos = _run(job, world, step_s, during=kill_workers)
        code = job.wait(30)
    same = all(a[0] == b[0] for a, b in zip(calm, chaos))
    print(
        f"{world} ranks, {steps} steps of {step_s * 1000:.0f} ms, 4 sources, 4 workers; "
        f"{len(done)} workers SIGKILLed over {time.monotonic() - started:.0f}s"
    )
    print(f"batches identical to the undisturbed run: {same}")
    for name, run in (("undisturbed", calm), ("with kills", chaos)):
        waits = sorted(w for _, ranks_waits in run for w in ranks_waits[1:])  # the first waits for startup
        print(f"  {name:12s} longest wait for a batch {waits[-1]:.3f}s, p99 {waits[int(len(waits) * 0.99)]:.3f}s")
    print(f"coordinator exit code {code} (0: every rank got every step)")


def chaos_throttle(seconds: float, every: int) -> None:
    import omniload
    from scripts.bench_data import make_sources
    from tests.s3_store import CREDENTIALS, FaultyProxy, MotoServer

    store = MotoServer()
    try:
        local = make_sources(2, 4000)
        client = store.client()
        client.create_bucket(Bucket="corpus")
        sources = []
        for source in local:
            folder = Path(source["path"]).parent
            for path in sorted(folder.glob(Path(source["path"]).name)):
                client.put_object(Bucket="corpus", Key=f"{folder.name}/{path.name}", Body=path.read_bytes())
            sources.append({**source, "path": f"s3://corpus/{folder.name}/{Path(source['path']).name}"})
        step_s, world = 0.05, 2
        steps = int(seconds / step_s)
        spec = {"sources": sources, "seq_len": 512, "rows": 2, "workers": 2, "seed": 1, "epochs": 0, "steps": steps}
        os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": store.endpoint})
        with omniload.Job(spec) as job:
            calm = _run(job, world, 0.0)
        proxy = FaultyProxy(store.port, throttle_every=every)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        started = time.monotonic()
        with omniload.Job(spec) as job:
            throttled = _run(job, world, step_s)
            code = job.wait(30)
        proxy.close()
    finally:
        store.stop()
    same = all(a[0] == b[0] for a, b in zip(calm, throttled))
    print(
        f"{world} ranks, {steps} steps over {time.monotonic() - started:.0f}s reading S3 through a proxy that "
        f"answered 503 SlowDown to {proxy.throttled} of {proxy.connections} connections (one in {every})"
    )
    print(f"batches identical to the unthrottled run: {same}; coordinator exit code {code}")


def chaos_fuzz(rounds: int, idle: int, steps: int, senders: int = 0) -> None:
    import omniload
    from omniload.protocol import PREFIX, VERSION, Kind, Message, encode
    from scripts.bench_data import make_sources

    spec = {
        "sources": make_sources(4, 2000),
        "seq_len": 256,
        "rows": 2,
        "workers": 2,
        "steps": steps,
        "senders": senders,
    }
    with omniload.Job(spec) as job:
        calm = _run(job, 2, 0.0)
    rng = random.Random(1)
    answered = {"error frame": 0, "closed": 0}

    def fuzz(job) -> None:
        host, port = job.addr.rsplit(":", 1)
        coordinator = psutil.Process(job._process.pid)
        holders = [coordinator] + [p for p in coordinator.children() if "coordinator.sender" in " ".join(p.cmdline())]
        while (
            sum(
                c.laddr.port == int(port) and c.status == psutil.CONN_ESTABLISHED
                for holder in holders
                for c in holder.net_connections("tcp")
            )
            < 2
        ):
            time.sleep(0.05)  # the good ranks hold ranks 0 and 1 first: a HELLO for them is then a duplicate
        sockets = [socket.create_connection((host, int(port))) for _ in range(idle)]
        before = coordinator.memory_info().rss
        hello = encode(Message(Kind.HELLO, {"token": job.token, "rank": 0, "world_size": 2}))
        frames = [
            lambda: rng.randbytes(rng.randint(16, 8192)),
            lambda: hello[: rng.randint(1, len(hello) - 1)],
            lambda: PREFIX.pack(b"OL", VERSION, Kind.HELLO, 1 << 31, 0),
            lambda: PREFIX.pack(b"OL", VERSION + 1, Kind.HELLO, 2, 0) + b"{}",
            lambda: encode(Message(Kind.HELLO, {"token": "wrong", "rank": 0, "world_size": 2})),
            lambda: hello,
            lambda: encode(Message(Kind.ACK, {"step": 10**9})),
        ]
        for _ in range(rounds):
            for make in frames:
                with socket.create_connection((host, int(port)), timeout=15) as sock:
                    sock.sendall(make())
                    sock.shutdown(socket.SHUT_WR)
                    answered["error frame" if sock.recv(65536)[:2] == b"OL" else "closed"] += 1
            answered["rounds"] = answered.get("rounds", 0) + 1
        answered["memory growth MB"] = (coordinator.memory_info().rss - before) / 2**20
        for sock in sockets:
            sock.close()

    with omniload.Job(spec) as job:
        chaos = _run(job, 2, 0.01, during=fuzz)
        code = job.wait(30)
    print(f"{answered['rounds'] * 7} bad connections and {idle} idle sockets beside 2 good ranks over {steps} steps")
    print(f"good ranks' batches identical to an undisturbed run: {all(a[0] == b[0] for a, b in zip(calm, chaos))}")
    print(f"coordinator exit code {code} (0: no crash); answers {answered}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    workers = sub.add_parser("workers")
    workers.add_argument("--kills", type=int, default=100)
    workers.add_argument("--steps", type=int, default=1500)
    workers.add_argument("--ranks", type=int, default=2)
    workers.add_argument("--step-ms", type=float, default=40)
    throttle = sub.add_parser("throttle")
    throttle.add_argument("--seconds", type=float, default=60)
    throttle.add_argument("--every", type=int, default=5, help="one connection in this many is refused")
    fuzz = sub.add_parser("fuzz")
    fuzz.add_argument("--rounds", type=int, default=200)
    fuzz.add_argument("--idle", type=int, default=500)
    fuzz.add_argument("--steps", type=int, default=1500)
    fuzz.add_argument("--senders", type=int, default=0, help="sender processes holding the ranks' connections")
    args = parser.parse_args()
    os.environ.setdefault("OMNILOAD_LOG", "WARNING")
    if args.what == "workers":
        chaos_workers(args.kills, args.steps, args.ranks, args.step_ms / 1000)
    elif args.what == "throttle":
        chaos_throttle(args.seconds, args.every)
    else:
        chaos_fuzz(args.rounds, args.idle, args.steps, args.senders)


if __name__ == "__main__":
    main()
