"""torchtitan's data loader side on CPU (its Trainer needs an accelerator): OmniloadDataLoader
built through torchtitan's own Configurable `build()` as its Trainer builds it, iterated as
its `batch_generator` does, and saved and loaded with torch.distributed.checkpoint under the
key its checkpointer uses. Run under torchrun by tests/integration/test_recipes.py, with the
recipes' arguments: --steps N --checkpoint-dir DIR --save-every K --record OUT [--resume].
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import DATALOADER

from omniload.integrations.torchtitan import OmniloadDataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--steps", "--save-every"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataloader = OmniloadDataLoader.Config().build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=64, local_batch_size=2, snapshot_every_n_steps=None
    )
    step = 0  # torchtitan's train_state step: steps trained
    if args.resume:
        step = int(open(f"{args.checkpoint_dir}/step").read())
        dcp.load({DATALOADER: dataloader}, checkpoint_id=f"{args.checkpoint_dir}/step-{step}")
    for inputs, _labels in dataloader:
        digest = hashlib.blake2b(inputs["input"].numpy().tobytes(), digest_size=8).hexdigest()
        with open(args.record.format(rank=rank), "a") as f:
            f.write(json.dumps({"step": step, "digest": digest}) + "\n")
        step += 1
        if step % args.save_every == 0:
            dcp.save({DATALOADER: dataloader}, checkpoint_id=f"{args.checkpoint_dir}/step-{step}")
            if rank == 0:
                open(f"{args.checkpoint_dir}/step", "w").write(str(step))
            dist.barrier()
        if step >= args.steps:
            break
    dataloader.loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
