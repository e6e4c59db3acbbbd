"""`python -m omniload.coordinator`: the coordinator process that `omniload.Job` starts.

Reads the spec as JSON on stdin and the token from OMNILOAD_TOKEN; prints one JSON line
`{"addr": "HOST:PORT", "metrics": "HOST:PORT" or null}` on stdout when ranks can connect;
exits with the job's code. With --standby, the line comes at once with the address it will
listen on if it takes over (coordinator/ha/following.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Arrow's C++ default allocator (mimalloc) keeps freed pages for reuse, several MB per process;
# the system one gives them back. Arrow reads this once, when pyarrow is imported, so it is set
# before any import that pulls pyarrow in; the workers' forkserver inherits it.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

from omniload.coordinator.observe.logs import setup_logging  # noqa: E402
from omniload.coordinator.server import Coordinator  # noqa: E402
from omniload.errors import ConfigError  # noqa: E402
from omniload.spec import Spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m omniload.coordinator")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--standby", action="store_true", help="follow the primary; serve only after taking over")
    args = parser.parse_args()
    setup_logging()
    try:
        spec = Spec.from_dict(json.load(sys.stdin))
        coordinator = Coordinator(
            spec,
            os.environ["OMNILOAD_TOKEN"],
            args.host,
            args.port,
            announce=lambda addr, metrics: print(json.dumps({"addr": addr, "metrics": metrics}), flush=True),
            job_id=args.job_id,
            exit_with_parent=True,
            standby=args.standby,
        )
        return coordinator.run()
    except ConfigError as exc:
        print(f"omniload: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
