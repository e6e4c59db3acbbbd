"""A prefetching trainer: it fetches the next batch before it saves, and saves the position of
the step it trained on with `loader.state_dict(step=...)`. Run under torchrun or in its environment
(tests/jobs.run_as_torchrun; gloo):

    prefetch_train.py save|load STATE OUT   (STATE and OUT may contain {rank})

save: trains on every batch to the end of the data and, after training step SAVE_AT (the next
batch already fetched), writes the loader's state_dict(step=SAVE_AT) to STATE; it also asks
for a step not handed out yet and records the error. load: loads STATE, then trains on the
rest. OUT gets {step: hash of the batch} for every step trained, and the error if any.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch.distributed as dist

import omniload

SAVE_AT = 6


def digest(batch: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(batch):
        h.update(name.encode() + batch[name].numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    mode, state_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = os.environ["RANK"]
    state_path, out = state_path.format(rank=rank), out.format(rank=rank)
    dist.init_process_group("gloo")
    loader = omniload.connect()
    if mode == "load":
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
    trained, error = {}, None
    it = iter(loader)
    batch = next(it, None)
    while batch is not None:
        step = loader.step
        trained[step] = digest(batch)  # the training step
        batch = next(it, None)  # prefetch: loader.step is step + 1 from here
        if mode == "save" and step == SAVE_AT:
            with open(state_path, "w") as f:
                json.dump(loader.state_dict(step=step), f)
            try:
                loader.position(loader.step + 1)  # collective: raises on every rank
            except omniload.OmniloadError as exc:
                error = str(exc)
    loader.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"trained": trained, "error": error}, f)


if __name__ == "__main__":
    main()
