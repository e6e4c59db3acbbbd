"""torchtitan on omniload: its Llama 3 debug model trained on the batches omniload plans.

    omniload launch --source "web=data/*.parquet" --tokenizer assets/tokenizer.json \
        --seq-len 2048 --rows 8 --steps 1000 \
        -- torchrun --nproc-per-node 8 examples/torchtitan/train.py \
           --hf-assets assets --seq-len 2048 --rows 8 --steps 1000 --dump-folder outputs
    # ...stopped? the same command goes on from the newest checkpoint in outputs/checkpoint

Needs torchtitan (`pip install -e '.[torchtitan]'`) and an accelerator: torchtitan's Trainer
runs on CUDA (or another accelerator), not on a CPU. Written to torchtitan 0.3's documented
interface; its end-to-end test is skipped on our CPU machines (docs/recipes.md).

OmniloadDataLoader (omniload/integrations/torchtitan.py) is the `dataloader` component; the
checkpointer saves it with the model as a Stateful (DCP) at every `--save-every` step, and
torchtitan loads the newest checkpoint in the folder before the first step by itself. The
model's vocabulary must hold the tokenizer's (--hf-assets is the folder of the same
tokenizer.json that omniload's --tokenizer names).
"""

from __future__ import annotations

import argparse

import torch
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.tools.logging import init_logger

from omniload.integrations.torchtitan import OmniloadDataLoader


def main() -> None:
    args = parse_args()
    init_logger()
    config = llama3_debugmodel()
    config.hf_assets_path = args.hf_assets
    config.dump_folder = args.dump_folder
    config.dataloader = OmniloadDataLoader.Config()
    config.training.seq_len = args.seq_len  # the job's --seq-len and --rows: the loader refuses others
    config.training.local_batch_size = args.rows
    config.training.steps = args.steps
    config.checkpoint.enable = True
    config.checkpoint.interval = args.save_every
    config.checkpoint.last_save_model_only = False  # the last checkpoint keeps the loader too
    config.validator.enable = False
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-assets", required=True, help="the tokenizer's folder (tokenizer.json and its config)")
    parser.add_argument("--seq-len", type=int, required=True, help="the job's --seq-len")
    parser.add_argument("--rows", type=int, required=True, help="the job's --rows")
    parser.add_argument("--steps", type=int, required=True, help="train until this many steps in all")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--dump-folder", default="outputs", help="torchtitan's output folder (checkpoints inside)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
