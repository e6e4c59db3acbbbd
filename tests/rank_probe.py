"""A rank process for the tests: consume a job and write what it saw as JSON.

Usage: python tests/rank_probe.py OUT.json [MAX_STEPS]   (OMNILOAD_*, RANK, WORLD_SIZE from env;
PROBE_STEP_S: seconds each step takes, like a training step (PROBE_SLOW_AFTER=N: only after
the first N steps, which go as fast as they can); PROBE_HANG_AFTER=N: stop consuming
after N batches and sleep, like a rank stuck in a collective; PROBE_NO_CLOSE=1: end without
close(), as many trainers do; PROBE_GATE=FILE: take a step only while FILE holds a number above
the steps taken, so a test acts at the steps it chose however slow the machine). Under
torchrun, OUT may contain {rank}; the probe joins the gloo process group (needed for
broadcast_at=tp). Each step's segments are recorded as
[sample_id, tokens, crc32 of their input_ids as int64] ("step_segments", padding included;
empty where the rank holds slices of the rows, with context parallelism), and the shape of its
input_ids ("shapes"). With images, each
image is recorded as [sample_id of its segment, its top-left pixel's r, g, b] ("images"), and
each step's count of PROBE_IMAGE_TOKEN tokens and of images ("image_tokens"). With PROBE_LABELS=1,
each step's segments are recorded with their labels too: [sample_id, tokens, crc32 of their
input_ids, crc32 of their labels], both as int64 ("step_labels"). Each step's max rank cost
over its lower bound, from the batch's meta ("to_bound").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import zlib
from pathlib import Path

import omniload


def _gate(path: str) -> int:
    try:
        return int(Path(path).read_text() or 0)
    except (OSError, ValueError):  # not written yet
        return 0


def main() -> None:
    out, max_steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
    out = out.format(rank=os.environ.get("RANK", "0"))
    if "MASTER_ADDR" in os.environ:  # under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
    loader = omniload.connect()
    step_seconds = float(os.environ.get("PROBE_STEP_S", 0))
    slow_after = int(os.environ.get("PROBE_SLOW_AFTER", 0))
    hang_after = int(os.environ.get("PROBE_HANG_AFTER", 0))
    gate = os.environ.get("PROBE_GATE")
    hashes, sample_ids, source_tokens, steps, waits, step_segments, shapes = [], [], {}, [], [], [], []
    to_bound = []  # each step's max rank cost over its lower bound
    images, image_tokens, step_labels = [], [], []
    with_labels = os.environ.get("PROBE_LABELS") == "1"
    image_token = int(os.environ.get("PROBE_IMAGE_TOKEN", -1))
    waited = 0.0
    for batch in loader:
        waits.append(loader.wait_seconds - waited)  # how long this batch kept the rank waiting
        waited = loader.wait_seconds
        while gate and _gate(gate) <= len(hashes):
            time.sleep(0.01)
        time.sleep(step_seconds if len(hashes) >= slow_after else 0.0)
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(batch):
            digest.update(name.encode() + batch[name].numpy().tobytes())
        hashes.append(digest.hexdigest())
        steps.append(loader.step)
        to_bound.append(loader.meta.get("to_bound"))
        shapes.append(list(batch["input_ids"].shape) if "input_ids" in batch else [])
        lengths = (batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).tolist()
        step_segments.append(_segments(batch, lengths))
        if with_labels:
            step_labels.append(_segments(batch, lengths, with_labels=True))
        if "pixel_values" in batch:
            ids = batch["sample_id"].tolist()
            images += [
                [ids[seg], *pixels[:, 0, 0].tolist()]
                for seg, pixels in zip(batch["image_index"].tolist(), batch["pixel_values"])
            ]
            image_tokens.append([int((batch["input_ids"] == image_token).sum()), len(batch["pixel_values"])])
        for source, sid, length in zip(batch["source"].tolist(), batch["sample_id"].tolist(), lengths):
            if source >= 0:
                sample_ids.append(sid)
                source_tokens[source] = source_tokens.get(source, 0) + length
        if hang_after and len(hashes) >= hang_after:
            time.sleep(3600)
        if max_steps and len(hashes) >= max_steps:
            break
    if not os.environ.get("PROBE_NO_CLOSE"):
        loader.close()
    if "MASTER_ADDR" in os.environ:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(
            {
                "hashes": hashes,
                "steps": steps,
                "to_bound": to_bound,
                "sample_ids": sample_ids,
                "source_tokens": source_tokens,
                "wait_seconds": loader.wait_seconds,
                "waits": waits,
                "step_segments": step_segments,
                "shapes": shapes,
                "images": images,
                "image_tokens": image_tokens,
                "step_labels": step_labels,
                "served_by": {
                    k: (getattr(loader, "_info", None) or {}).get(k) for k in ("pid", "host", "role", "epoch")
                },
            },
            f,
        )


def _segments(batch: dict, lengths: list[int], with_labels: bool = False) -> list[list[int]]:
    if "input_ids" not in batch or batch["input_ids"].numel() != sum(lengths):
        return []  # context parallelism: this rank holds slices of the rows
    tokens = batch["input_ids"].reshape(-1).numpy()
    labels = batch["labels"].reshape(-1).numpy()
    bounds = batch["cu_seqlens"].tolist()
    return [
        [sid, length, zlib.crc32(tokens[start : start + length].astype("int64").tobytes())]
        + ([zlib.crc32(labels[start : start + length].astype("int64").tobytes())] if with_labels else [])
        for sid, length, start in zip(batch["sample_id"].tolist(), lengths, bounds)
    ]


if __name__ == "__main__":
    main()
