"""A relay per node: the node's ranks share one connection, and get the same bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import omniload
from tests.corpus import mixed_sources
from tests.jobs import PROBE, ROOT, collect, senders_of, start_ranks
from tests.rank_forkserver import spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _start_relay(job: omniload.Job, path: Path, cmd: list[str] = ()) -> subprocess.Popen:
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omniload.cli",
            "relay",
            "--addr",
            job.addr,
            "--token",
            job.token,
            "--socket",
            str(path),
            *(["--", *cmd] if cmd else []),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not path.exists():
        assert relay.poll() is None, f"the relay exited {relay.returncode}: {relay.stderr.read()}"
        assert time.monotonic() < deadline, "the relay did not listen in 30 s"
        time.sleep(0.05)
    return relay


def _coordinator_connections(job: omniload.Job) -> int:
    port = int(job.addr.rsplit(":", 1)[1])
    return sum(
        c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
        for c in psutil.Process(job._process.pid).net_connections("tcp")
    )


def _spec(corpus: dict[str, str]) -> dict:
    return {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 2, "seed": 5, "steps": 40}


def test_ranks_behind_a_relay_and_ranks_on_senders_get_the_bytes_of_direct_connections(corpus, tmp_path):
    with omniload.Job({**_spec(corpus), "senders": 0}) as job:
        direct = collect(start_ranks(job, 4, tmp_path))

    with omniload.Job({**_spec(corpus), "senders": 2}) as job:
        path = tmp_path / "node1.sock"
        relay = _start_relay(job, path)  # ranks 2 and 3 share it; ranks 0 and 1 connect directly
        ranks = [
            _probe(
                job,
                rank,
                4,
                tmp_path,
                {"PROBE_STEP_S": "0.05"} if rank < 2 else {"PROBE_STEP_S": "0.05", "OMNILOAD_ADDR": f"unix:{path}"},
            )
            for rank in range(4)
        ]
        _wait_for_local_ranks(relay, path, 2)
        senders = senders_of(job)
        deadline = time.monotonic() + 60
        while sum(len(s.net_connections("tcp")) for s in senders) < 2:
            assert time.monotonic() < deadline, "the senders never held the two direct ranks' connections"
            time.sleep(0.05)
        connections = _coordinator_connections(job)
        held = sorted(len(s.net_connections("tcp")) for s in senders)
        vias = {rank["rank"]: rank["via"] for rank in job.status()["ranks"]}
        served = collect(ranks)
        assert relay.wait(30) == 0, relay.stderr.read()
    assert [r["hashes"] for r in served] == [r["hashes"] for r in direct], "relay and senders change no byte"
    assert connections == 1, "the relay holds one connection to the coordinator for both its ranks"
    assert held == [1, 1], "each sender holds one of the two direct ranks' connections"
    assert vias[2].startswith("relay 127.0.0.1:") and vias[3] == vias[2], vias
    assert sorted(vias[r].split(" (")[0] for r in (0, 1)) == ["sender 0", "sender 1"], vias
    assert not path.exists(), "a relay removes its socket when it ends"


def _probe(job: omniload.Job, rank: int, world: int, out_dir: Path, env: dict[str, str]) -> tuple:
    out = out_dir / f"relayed{rank}.json"
    process = spawn([str(out)], env={**os.environ, **job.env(), "RANK": str(rank), "WORLD_SIZE": str(world), **env})
    return process, out


def test_a_dead_relay_ends_its_ranks_with_an_error_naming_it_and_the_job_lives_on(corpus, tmp_path):
    spec = {**_spec(corpus), "steps": 0, "epochs": 0, "rank_timeout": 0}
    with omniload.Job(spec) as job:
        path = tmp_path / "node0.sock"
        relay = _start_relay(job, path)
        ranks = [
            _probe(job, rank, 2, tmp_path, {"OMNILOAD_ADDR": f"unix:{path}", "PROBE_STEP_S": "0.02"})
            for rank in range(2)
        ]
        _wait_for_local_ranks(relay, path, 2)
        time.sleep(0.5)
        relay.send_signal(signal.SIGKILL)
        relay.wait(10)
        for process, _ in ranks:
            _, stderr = process.communicate(timeout=30)
            assert process.returncode != 0
            assert f"lost the coordinator at unix:{path}" in stderr, stderr[-1000:]
        assert job.poll() is None, "the coordinator serves on: the ranks may come back through another relay"
        path.unlink()


def _wait_for_local_ranks(relay: subprocess.Popen, path: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while sum(c.laddr == str(path) for c in psutil.Process(relay.pid).net_connections("unix")) < count + 1:
        assert time.monotonic() < deadline, f"{count} ranks did not connect to the relay in 60 s"
        time.sleep(0.05)


def _netns(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.77.0.1 (coordinator) and 10.77.0.2 (a node)."""
    tag = os.urandom(2).hex()
    a, b = f"olA{tag}", f"olB{tag}"
    try:
        _netns("netns", "add", a)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create network namespaces here ({exc}); run as root with `ip` installed")
    try:
        _netns("netns", "add", b)
        _netns("link", "add", f"ola{tag}", "type", "veth", "peer", "name", f"olb{tag}")
        for ns, end, ip in ((a, f"ola{tag}", "10.77.0.1"), (b, f"olb{tag}", "10.77.0.2")):
            _netns("link", "set", end, "netns", ns)
            _netns("-n", ns, "addr", "add", f"{ip}/24", "dev", end)
            _netns("-n", ns, "link", "set", end, "up")
            _netns("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_a_node_on_another_host_reaches_the_coordinator_through_its_relay(corpus, tmp_path, two_hosts):
    host_a, host_b = two_hosts
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(corpus)))
    with omniload.Job(_spec(corpus)) as job:
        direct = collect(start_ranks(job, 2, tmp_path))

    serve = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            host_a,
            sys.executable,
            "-m",
            "omniload.cli",
            "serve",
            "--config",
            str(spec),
            "--host",
            "10.77.0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        announced = dict(serve.stdout.readline().strip().split("=", 1) for _ in range(2))
        outs = [tmp_path / f"node{rank}.json" for rank in range(2)]
        ranks = " & ".join(f"RANK={rank} WORLD_SIZE=2 {sys.executable} {PROBE} {out}" for rank, out in enumerate(outs))
        node = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                host_b,
                sys.executable,
                "-m",
                "omniload.cli",
                "relay",
                "--addr",
                announced["OMNILOAD_ADDR"],
                "--token",
                announced["OMNILOAD_TOKEN"],
                "--socket",
                str(tmp_path / "b.sock"),
                "--",
                "sh",
                "-c",
                f"{ranks} & wait",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=ROOT,
        )
        assert node.returncode == 0, node.stderr[-2000:]
        assert serve.wait(30) == 0, serve.stderr.read()[-2000:]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    relayed = [json.loads(out.read_text()) for out in outs]
    assert announced["OMNILOAD_ADDR"].startswith("10.77.0.1:")
    assert [r["hashes"] for r in relayed] == [r["hashes"] for r in direct]


def test_eight_ranks_connecting_at_once_through_one_relay_all_get_every_step(corpus, tmp_path):
    import threading

    spec = {**_spec(corpus), "steps": 6}
    with omniload.Job(spec) as job:
        path = tmp_path / "node.sock"
        relay = _start_relay(job, path)
        steps: dict[int, list[int]] = {}

        def rank(r: int) -> None:
            with omniload.connect(f"unix:{path}", job.token, rank=r, world_size=8) as loader:
                steps[r] = [loader.step for _ in loader]

        threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(8))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert relay.wait(30) == 0
    assert steps == {r: list(range(6)) for r in range(8)}
