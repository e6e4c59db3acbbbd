"""`omniload.Job`: run a coordinator for a spec from Python, as a child process.

The coordinator runs in a fresh interpreter (never a fork of the caller, which may hold
torch and threads). The child leaves with its parent: it watches for the parent's death, and
`stop()` terminates it and removes any shared memory it could not.

    with omniload.Job(spec) as job:
        subprocess.run(cmd, env={**os.environ, **job.env()})

With standby=N (needs spec.checkpoint_dir), N standby coordinators start beside the primary
and the ranks get every address; `poll()` replaces any coordinator that was killed (or lost
its lease) with a new standby at the same address, so a second failure is survived too.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from omniload.errors import ConfigError, OmniloadError
from omniload.spec import Spec

_STOP_S = 15.0
FENCED_EXIT = 75  # a coordinator's exit code when it lost its lease to a standby (EX_TEMPFAIL)


class Job:
    def __init__(
        self,
        spec: Spec | dict[str, Any],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        startup_timeout: float = 600.0,
        standby: int = 0,
    ) -> None:
        self.spec = spec if isinstance(spec, Spec) else Spec.from_dict(spec)
        if standby < 0 or (standby and not self.spec.checkpoint_dir):
            raise ConfigError(
                f"standby={standby}: standby coordinators need a checkpoint_dir (they follow its lease "
                "and delta log); give --checkpoint-dir, or --standby 0"
            )
        self.standby = standby
        self.addrs: list[str] = []  # the primary's, then each standby's: what OMNILOAD_ADDR lists
        self.coordinators: list[subprocess.Popen[bytes]] = []  # by address; a killed one is replaced by a standby
        self._job_ids: list[str] = []  # every coordinator's (shared-memory names), replaced ones too
        self.token = token or secrets.token_hex(16)
        self.job_id = secrets.token_hex(4)
        self.addr: str | None = None
        self.metrics_addr: str | None = None  # HOST:PORT of /metrics, with metrics_port set
        self._host, self._port = host, port
        self._startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=50)

    def start(self) -> Job:
        """Start the coordinator and wait until ranks can connect; raises ConfigError for bad input."""
        process = self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omniload.coordinator",
                "--host",
                self._host,
                "--port",
                str(self._port),
                "--job-id",
                self.job_id,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "OMNILOAD_TOKEN": self.token},
            start_new_session=True,
        )
        threading.Thread(target=self._relay_stderr, daemon=True).start()
        self._send_spec(process)
        ready = json.loads(self._read_ready_line())
        self.addr, self.metrics_addr = ready["addr"], ready.get("metrics")
        self.addrs, self.coordinators, self._job_ids = [ready["addr"]], [process], [self.job_id]
        for _ in range(self.standby):
            process, addr = self._start_standby(0)
            self.addrs.append(addr)
            self.coordinators.append(process)
        return self

    def _start_standby(self, port: int) -> tuple[subprocess.Popen[bytes], str]:
        """A standby coordinator (it follows the primary's lease; serves after taking over) and its address."""
        job_id = secrets.token_hex(4)
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omniload.coordinator",
                "--standby",
                "--host",
                self._host,
                "--port",
                str(port),
                "--job-id",
                job_id,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "OMNILOAD_TOKEN": self.token},
            start_new_session=True,
        )
        self._job_ids.append(job_id)
        threading.Thread(target=self._relay_stderr, args=(process,), daemon=True).start()
        self._send_spec(process)
        addr: str = json.loads(self._read_ready_line(process))["addr"]
        return process, addr

    def _send_spec(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdin is not None  # started with stdin=PIPE
        process.stdin.write(json.dumps(self.spec.to_dict()).encode())
        process.stdin.close()

    def _started(self, process: subprocess.Popen[bytes] | None = None) -> subprocess.Popen[bytes]:
        """`process`, else the primary coordinator; raises OmniloadError before start()."""
        process = process or self._process
        if process is None:
            raise OmniloadError("the job has not been started: call start() first (or use it in a with block)")
        return process

    def _started_addr(self) -> str:
        if self.addr is None:
            raise OmniloadError("the job has not been started: call start() first (or use it in a with block)")
        return self.addr

    def _replace_lost(self) -> int | None:
        """Replace each coordinator that was killed or fenced by a standby at its address; the
        job's exit code once a coordinator ended it (0: done), else None."""
        for slot, process in enumerate(self.coordinators):
            code = process.poll()
            if code is None:
                continue
            if code >= 0 and code != FENCED_EXIT:
                return code
            what = f"was killed by signal {-code}" if code < 0 else "lost its lease"
            sys.stderr.write(f"omniload: the coordinator at {self.addrs[slot]} {what}; starting a standby there\n")
            port = int(self.addrs[slot].rsplit(":", 1)[1])
            self.coordinators[slot], _ = self._start_standby(port)
            if slot == 0:
                self._process = self.coordinators[0]
        self.addr = self._primary_addr() or self.addr
        return None

    def _primary_addr(self) -> str | None:
        from omniload.coordinator.ha.lease import read_lease  # not a rank's import

        if self.spec.checkpoint_dir is None:  # never with standbys (__init__ checks)
            return None
        held = read_lease(self.spec.checkpoint_dir)
        return held.addr if held is not None and held.addr in self.addrs else None

    def env(self) -> dict[str, str]:
        """What a rank's environment needs for `omniload.connect()` to find this job."""
        return {
            "OMNILOAD_ADDR": ",".join(self.addrs) or self.addr or "",
            "OMNILOAD_TOKEN": self.token,
            "OMNILOAD_BROADCAST_AT": self.spec.broadcast_at,
        }

    def set_weights(self, weights: dict[str, float]) -> int:
        """Change the mixture while the job runs; returns the step the change takes effect at."""
        from omniload.control import set_weights

        return set_weights(self._started_addr(), self.token, weights)

    def status(self) -> dict[str, Any]:
        """The running job's figures: per source, per rank and for the planner (as `omniload status --json`)."""
        from omniload.control import job_status

        return job_status(self._started_addr(), self.token)

    def log_tail(self) -> list[str]:
        """The coordinator's last lines of log (it also relays them to this process's stderr)."""
        return list(self._stderr_tail)

    def poll(self) -> int | None:
        """The coordinator's exit code, None while it runs; with standbys, the job's (see _replace_lost)."""
        if self.standby and self.coordinators:
            return self._replace_lost()
        return self._process.poll() if self._process else None

    def wait(self, timeout: float | None = None) -> int:
        return self._started().wait(timeout)

    def stop(self) -> int:
        """Shut the coordinator down (SIGTERM, then SIGKILL) and clean up after it."""
        process = self._process
        if process is None:
            return 0
        for other in self.coordinators[1:]:  # the others (standbys, or a promoted one) too: all end with the job
            stop_process(other, _STOP_S)
        stop_process(process, _STOP_S)
        from omniload.formats.ring import job_segments  # not a rank's import: keeps psutil off ranks

        for job_id in self._job_ids or [self.job_id]:
            for path in job_segments(job_id):
                path.unlink(missing_ok=True)
        return process.returncode

    def __enter__(self) -> Job:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read_ready_line(self, process: subprocess.Popen[bytes] | None = None) -> str:
        process = self._started(process)
        assert process.stdout is not None  # started with stdout=PIPE
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if selector.select(timeout=0.2):
                line = process.stdout.readline().decode()
                if line:
                    return line
            if process.poll() is not None:
                process.wait()
                time.sleep(0.1)  # let the relay thread take the last lines
                last = self._last_line()
                reason = (
                    self._last_error()
                    or f"the coordinator exited with code {process.returncode} before it was ready"
                    + (f": {last}" if last else "")
                )
                error = ConfigError if process.returncode == 2 else OmniloadError
                raise error(reason)
        last = self._last_line()
        self.stop()
        raise OmniloadError(
            f"the coordinator was not ready after {self._startup_timeout:.0f}s"
            + (f" (its last line: {last})" if last else "")
            + "; the usual cause is a large bucket: a start without a kept catalog lists and indexes every "
            "object of its sources first. Give it more time (Job(..., startup_timeout=SECONDS)), or start "
            "from the catalog a finished start kept (--cache-dir) or from a manifest (`omniload index`)"
        )

    def _last_line(self) -> str | None:
        """The coordinator's last line of its own on stderr, without its prefix."""
        mine = [line.removeprefix("omniload: ") for line in self._stderr_tail if line.startswith("omniload: ")]
        return mine[-1] if mine else None

    def _last_error(self) -> str | None:
        """The coordinator's last error message, with the lines that continue it."""
        lines = list(self._stderr_tail)
        starts = [i for i, line in enumerate(lines) if line.startswith("omniload: error: ")]
        if not starts:
            return None
        first, *rest = lines[starts[-1] :]
        rest = [line for line in rest if not line.startswith("omniload: ")]
        return "\n".join([first.removeprefix("omniload: error: "), *rest])

    def _relay_stderr(self, process: subprocess.Popen[bytes] | None = None) -> None:
        stderr = self._started(process).stderr
        assert stderr is not None  # started with stderr=PIPE
        for raw in stderr:
            line = raw.decode(errors="replace")
            self._stderr_tail.append(line.rstrip())
            sys.stderr.write(line)
            sys.stderr.flush()


def stop_process(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
