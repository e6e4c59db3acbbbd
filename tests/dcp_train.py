"""A training script that saves and loads the loader with the model through
torch.distributed.checkpoint (gloo, CPU). Run under torchrun or in its environment
(tests/jobs.run_as_torchrun):

    dcp_train.py save|load CHECKPOINT_DIR OUT   (OUT may contain {rank})
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import omniload

SAVE_AT = 10


def main() -> None:
    mode, folder, out = sys.argv[1], sys.argv[2], sys.argv[3].format(rank=os.environ["RANK"])
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    loader = omniload.connect()
    if mode == "load":
        state = {"model": model.state_dict(), "loader": loader}
        dcp.load(state, checkpoint_id=folder)  # calls loader.load_state_dict
        model.load_state_dict(state["model"])
    seen = {}
    for batch in loader:
        seen[loader.step] = hashlib.blake2b(batch["input_ids"].numpy().tobytes(), digest_size=16).hexdigest()
        if mode == "save" and len(seen) == SAVE_AT:
            dcp.save({"model": model.state_dict(), "loader": loader}, checkpoint_id=folder)
            break
    loader.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
