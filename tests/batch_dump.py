"""A torchrun rank for the tests: consume a job and save every batch it got.

Usage: python tests/batch_dump.py OUT_DIR   (OMNILOAD_*, RANK, WORLD_SIZE as torchrun and
`omniload launch` give them, or tests/jobs.run_as_torchrun). Writes OUT_DIR/rank{RANK}.npz with
each step's tensors as "{step}/{name}", and OUT_DIR/rank{RANK}.json with each step's loader.meta.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch.distributed as dist

import omniload


def main() -> None:
    out, rank = sys.argv[1], os.environ["RANK"]
    dist.init_process_group("gloo")
    arrays, metas = {}, []
    with omniload.connect() as loader:
        for batch in loader:
            arrays.update({f"{loader.step}/{name}": t.numpy() for name, t in batch.items()})
            metas.append(loader.meta)
    dist.destroy_process_group()
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(metas, f)


if __name__ == "__main__":
    main()
