"""A rank process for the tests: consume a job and write what it saw as JSON.

Usage: python tests/rank_probe.py OUT.json [MAX_STEPS]   (OMNILOAD_*, RANK, WORLD_SIZE from env;
PROBE_STEP_S: seconds each step takes, like a training step). Under torchrun, OUT may
contain {rank}; the probe joins the gloo process group (needed for broadcast_at=tp).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import omniload


def main() -> None:
    out, max_steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
    out = out.format(rank=os.environ.get("RANK", "0"))
    if "MASTER_ADDR" in os.environ:  # under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
    loader = omniload.connect()
    step_seconds = float(os.environ.get("PROBE_STEP_S", 0))
    hashes, sample_ids, source_tokens, steps = [], [], {}, []
    for batch in loader:
        time.sleep(step_seconds)
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(batch):
            digest.update(name.encode() + batch[name].numpy().tobytes())
        hashes.append(digest.hexdigest())
        steps.append(loader.step)
        lengths = (batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).tolist()
        for source, sid, length in zip(batch["source"].tolist(), batch["sample_id"].tolist(), lengths):
            if source >= 0:
                sample_ids.append(sid)
                source_tokens[source] = source_tokens.get(source, 0) + length
        if max_steps and len(hashes) >= max_steps:
            break
    loader.close()
    if "MASTER_ADDR" in os.environ:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"hashes": hashes, "steps": steps, "sample_ids": sample_ids,
                   "source_tokens": source_tokens, "wait_seconds": loader.wait_seconds}, f)


if __name__ == "__main__":
    main()
