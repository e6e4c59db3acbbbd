"""Run a real job with real rank processes and collect what each rank saw."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

import omniload
from omniload.coordinator.checkpoint.folder import last_position
from tests.rank_forkserver import ForkedRank, spawn

PROBE = Path(__file__).parent / "rank_probe.py"
# torchrun on this host (gloo, CPU), as the command of `omniload launch -- ...`; then --nproc_per_node and the script
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
ROOT = Path(__file__).parent.parent


def start_ranks(
    job: omniload.Job, world: int, out_dir: Path, max_steps: int = 0, env: dict[str, str] | None = None
) -> list[tuple[ForkedRank, Path]]:
    """`world` rank processes running tests/rank_probe.py (forked with torch imported: see rank_forkserver)."""
    ranks = []
    for rank in range(world):
        out = out_dir / f"rank{rank}-{os.urandom(3).hex()}.json"
        process = spawn(
            [str(out), str(max_steps)],
            env={**os.environ, **job.env(), "RANK": str(rank), "WORLD_SIZE": str(world), **(env or {})},
        )
        ranks.append((process, out))
    return ranks


def collect(ranks: list[tuple[ForkedRank, Path]], timeout: float = 90) -> list[dict[str, Any]]:
    wait_all([process for process, _ in ranks], timeout)
    return [json.loads(out.read_text()) for _, out in ranks]


def wait_all(processes: list[ForkedRank], timeout: float, what: str = "rank") -> None:
    """Wait for every rank, reading their stderr together (a rank that fills its pipe must not
    wait on one stuck in a collective); the first to fail stops the others, as torchrun does,
    and is the one named."""
    errors: dict[int, str] = {}

    def drain(index: int, process: ForkedRank) -> None:
        try:
            errors[index] = process.communicate(timeout=timeout)[1]
        except (subprocess.TimeoutExpired, RuntimeError) as exc:
            errors[index] = f"({exc})"

    readers = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(processes)]
    for reader in readers:
        reader.start()
    failed: int | None = None
    while failed is None and any(reader.is_alive() for reader in readers):
        failed = next((i for i, p in enumerate(processes) if p.returncode not in (None, 0)), None)
        time.sleep(0.02)
    for process in processes:  # those still running: the rest of a failed job's ranks
        _kill_running(process)
    for reader in readers:
        reader.join(10)
    if failed is None:
        failed = next((i for i, p in enumerate(processes) if p.returncode != 0), None)
    if failed is not None:
        raise AssertionError(f"{what} {failed} exited {processes[failed].returncode}: {errors.get(failed, '')[-2000:]}")


def run_ranks(
    spec: dict[str, Any], world: int, out_dir: Path, max_steps: int = 0, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    with omniload.Job(spec) as job:
        return collect(start_ranks(job, world, out_dir, max_steps, env))


def lockstep_batches(spec: dict[str, Any], world: int) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Per rank, ({"STEP/NAME": array}, [loader.meta of each step]), as tests/batch_dump.py saves
    them, from `world` loaders in this process stepping together as ranks under torchrun do: an
    uninterrupted job's batches, without starting ranks."""
    with omniload.Job(spec) as running:
        env = running.env()
        addr, token = env["OMNILOAD_ADDR"], env["OMNILOAD_TOKEN"]
        loaders = [omniload.connect(addr, token, rank=r, world_size=world) for r in range(world)]
        seen: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [({}, []) for _ in range(world)]
        for batches in zip(*loaders):
            for (arrays, metas), loader, batch in zip(seen, loaders, batches):
                arrays.update({f"{loader.step}/{name}": tensor.numpy() for name, tensor in batch.items()})
                metas.append(loader.meta)
        for loader in loaders:
            loader.close()
    return seen


def lockstep_digests(spec: dict[str, Any], world: int, digest_size: int = 8) -> list[dict[int, str]]:
    """Per rank, step -> blake2b of its input_ids (lockstep_batches')."""
    import hashlib

    digests = []
    for arrays, _ in lockstep_batches(spec, world):
        steps = sorted({int(key.split("/")[0]) for key in arrays})
        digests.append(
            {
                step: hashlib.blake2b(arrays[f"{step}/input_ids"].tobytes(), digest_size=digest_size).hexdigest()
                for step in steps
            }
        )
    return digests


def checkpointed_step(folder: Path) -> int:
    """The last step the ranks consumed by the checkpoint folder's record; 0 before the first."""
    found = last_position(folder) if folder.exists() else None
    return found.step if found is not None else 0


def wait_for_checkpoint(folder: Path, at_least: int, timeout: float = 60) -> int:
    """Wait until the checkpoint folder records step `at_least` consumed; the step it records."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (step := checkpointed_step(folder)) >= at_least:
            return step
        time.sleep(0.05)
    raise AssertionError(f"the checkpoint never reached step {at_least} in {timeout:.0f}s")


def wait_connected(job: omniload.Job, count: int, timeout: float = 60) -> None:
    """Wait until `count` ranks hold a connection to the job's coordinator."""
    port = int(job.addr.rsplit(":", 1)[1])
    coordinator = psutil.Process(job._process.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            sum(
                c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in coordinator.net_connections("tcp")
            )
            >= count
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} ranks did not connect in {timeout:.0f}s")


def wait_for_status(
    job: omniload.Job, ready: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60
) -> dict[str, Any]:
    """Poll the job's status until `ready(status)`, and return that status: a test reaches a
    state by waiting on it, not by sleeping for a time that a slow machine may not honour."""
    deadline = time.monotonic() + timeout
    while True:
        status = job.status()
        if ready(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {timeout:.0f}s: steps {status['steps']}")
        time.sleep(0.05)


def wait_written(job: omniload.Job, timeout: float = 60) -> None:
    """Wait until the workers of every source have written tokens into its rings."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(source["tokens_written"] > 0 for source in job.status()["sources"]):
            return
        time.sleep(0.05)
    tail = "\n".join(job.log_tail())
    raise AssertionError(f"a source's workers wrote nothing in {timeout:.0f}s; the job's log:\n{tail}")


def senders_of(job: omniload.Job) -> list[psutil.Process]:
    """The coordinator's sender processes (--senders)."""
    return [
        p
        for p in psutil.Process(job._process.pid).children()
        if "omniload.coordinator.serve.sender_process" in " ".join(p.cmdline())
    ]


def workers_of(job: omniload.Job) -> list[psutil.Process]:
    """The coordinator's worker processes (children of its forkserver)."""
    coordinator = psutil.Process(job._process.pid)
    return [p for server in coordinator.children() for p in server.children()]


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, or one gone between two looks, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def forkserver_of(job: omniload.Job) -> list[psutil.Process]:
    """The forkserver the coordinator's workers come from (one, once the job has started)."""
    found = []
    for child in psutil.Process(job._process.pid).children():
        try:
            if "multiprocessing.forkserver" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # a child that left meanwhile (a sender not needed): not the forkserver
            pass
    return found


def omniload_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omniload.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def why_no_private_tmpfs() -> str | None:
    """Why a tmpfs of its own cannot be mounted in a mount namespace here, or None when it can."""
    if not shutil.which("unshare"):
        return "no unshare command"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=16k tmpfs /mnt"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"


def coordinator_on_a_small_disk(
    spec: dict[str, Any], disk: Path, kept: Path, size: str, token: str
) -> tuple[subprocess.Popen, str]:
    """A coordinator for `spec` in a mount namespace of its own where `disk` is a tmpfs of `size`
    (a disk that fills up); what the tmpfs holds when it exits is copied to `kept`, since the
    namespace goes with it. Returns the process and the address it announced."""
    spec_file = kept.parent / f"{disk.name}-spec.json"
    spec_file.write_text(json.dumps(spec))
    script = (
        f'mount -t tmpfs -o size={size} tmpfs "{disk}" && {sys.executable} -m omniload.coordinator '
        f'< "{spec_file}"; code=$?; cp -a "{disk}"/. "{kept}"/; exit $code'
    )
    coordinator = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "OMNILOAD_TOKEN": token},
    )
    return coordinator, json.loads(coordinator.stdout.readline())["addr"]  # type: ignore[union-attr]


def run_as_torchrun(job: omniload.Job, nproc: int, script: Path, *args: str, timeout: float = 120) -> None:
    """`nproc` ranks of `script` with the environment torchrun gives its ranks and the job's,
    forked with torch imported (rank_forkserver): for the tests about what ranks get. As under
    torchrun, the ranks meet at a TCPStore the launcher holds (TORCHELASTIC_USE_AGENT_STORE), so
    no port is picked and given away; torch runs on one thread (conftest). The tests of the
    user's command (the demo, the recipes, launch reading a bucket and launch --standby) start
    torchrun itself."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torchrun_env = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
    torchrun_env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    ranks: list[ForkedRank] = []
    try:
        for rank in range(nproc):
            env = {**os.environ, **job.env(), **torchrun_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            ranks.append(spawn(list(args), env, script=script))
        wait_all(ranks, timeout, f"{script.name} rank")
    finally:  # (the store lives until here: the ranks meet at it until they end)
        for process in ranks:  # a spawn that failed leaves the earlier ranks waiting for the rest
            _kill_running(process)


def _kill_running(process: ForkedRank) -> None:
    """SIGKILL a rank not known to have ended, without reading its connection (a reader thread
    of wait_all's may be reading it)."""
    if process.returncode is None:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
