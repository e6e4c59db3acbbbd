"""The Hugging Face Trainer on omniload: a tiny Llama built from its config (no download).

    omniload launch --source "web=data/*.parquet" --seq-len 256 --rows 4 --steps 100 \
        -- torchrun --nproc-per-node 2 examples/hf_trainer/train.py --steps 100 --checkpoint-dir out
    # ...stopped? the same command with --resume goes on from the last checkpoint-N in out/

OmniloadTrainer (omniload/integrations/hf.py) gives each rank its own omniload batches
without accelerate re-sharding them, writes the loader position into every checkpoint-N
folder, and restores it on resume_from_checkpoint (docs/recipes.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import omniload
from omniload.integrations.hf import OmniloadTrainer

VOCAB = 256  # --tokenizer bytes


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
    )
    training = TrainingArguments(
        output_dir=args.checkpoint_dir,
        max_steps=args.steps,  # the loader has no length
        save_strategy="steps",
        save_steps=args.save_every,
        ignore_data_skip=True,  # the loader resumes at its saved position: skipping again would lose batches
        per_device_train_batch_size=1,  # unused: omniload's --rows sets the batch
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if not torch.cuda.is_available() else None,
        ddp_find_unused_parameters=False,
    )
    trainer = OmniloadTrainer(model=model, args=training, loader=omniload.connect())
    if args.record:
        model.register_forward_pre_hook(recorder(args.record, trainer), with_kwargs=True)
    trainer.train(resume_from_checkpoint=args.resume or None)
    del trainer, model  # the wrapped DDP model holds the process group: free it first, or gloo's
    gc.collect()  # threads outlive it and abort the interpreter at exit (SIGABRT, 1 run in 4)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def recorder(pattern: str, trainer: OmniloadTrainer):
    """A forward pre-hook writing one line per step trained: which batch it was (the tests
    compare runs with it). Each optimizer step here is one batch."""
    path = pattern.format(rank=trainer.args.process_index)

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        digest = hashlib.blake2b(kwargs["input_ids"].cpu().numpy().tobytes(), digest_size=8).hexdigest()
        with open(path, "a") as f:
            f.write(json.dumps({"step": trainer.state.global_step, "digest": digest}) + "\n")

    return record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True, help="train until this many steps in all")
    parser.add_argument("--checkpoint-dir", required=True, help="the Trainer's output_dir")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --checkpoint-dir")
    parser.add_argument("--record", help="append each step's batch digest to this file ({rank} is replaced)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
