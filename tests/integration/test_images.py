"""Image-text sources end to end: parquet and WebDataset tar, pixels in the batch, exactly once,
resume, a corrupt image."""

from __future__ import annotations

from collections import Counter

import pytest

import omniload
from omniload.order import split_sample_id
from tests.corpus import (
    documents,
    encoded_image,
    image_color,
    image_samples,
    write_image_parquet,
    write_image_tar,
    write_parquet,
)
from tests.jobs import collect, run_ranks, start_ranks

pytest.importorskip("PIL")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN, PER_IMAGE = 300, 4  # 300 is outside the byte tokenizer's 0..255: every such token is a placeholder


def _corpus(tmp_path):
    parquet = image_samples(70, 1, long_every=9)  # some samples span two rows
    tar = image_samples(50, 2)
    write_image_parquet(tmp_path / "pq" / "a.parquet", parquet)
    write_image_tar(tmp_path / "wds" / "a.tar", tar)
    write_parquet(tmp_path / "text" / "a.parquet", documents(80, 3))
    spec = {
        "sources": [
            {"name": "pq", "path": str(tmp_path / "pq" / "*.parquet"), "image": "image"},
            {"name": "wds", "path": str(tmp_path / "wds" / "*.tar")},
            {"name": "text", "path": str(tmp_path / "text" / "*.parquet")},
        ],
        "seq_len": 64,
        "rows": 4,
        "workers": 2,
        "seed": 3,
        "image_size": "12x20",
        "image_token": TOKEN,
        "tokens_per_image": PER_IMAGE,
    }
    return spec, {0: parquet, 1: tar}


def _images_by_sample(ranks):
    """(source, ordinal) -> the colours of its images as delivered, and how often the sample came."""
    seen, samples = {}, Counter()
    for rank in ranks:
        for sid, r, g, b in rank["images"]:
            source, ordinal, _ = split_sample_id(sid)
            seen.setdefault((source, ordinal), []).append((r, g, b))
        for sid in rank["sample_ids"]:
            source, ordinal, chunk = split_sample_id(sid)
            if chunk == 0:
                samples[(source, ordinal)] += 1
    return seen, samples


def test_every_sample_arrives_once_with_its_own_images_beside_its_placeholders(tmp_path):
    spec, written = _corpus(tmp_path)
    ranks = run_ranks(spec, world=2, out_dir=tmp_path, env={"PROBE_IMAGE_TOKEN": str(TOKEN)})
    seen, samples = _images_by_sample(ranks)
    assert set(samples.values()) == {1} and len(samples) == 70 + 50 + 80
    for source, data in written.items():
        for ordinal, (_, images) in enumerate(data):
            # decoded, resized and cropped: a solid image keeps its exact colour, in the sample's order
            assert seen.get((source, ordinal), []) == [image_color(ordinal, k) for k in range(len(images))]
    for rank in ranks:  # each step: the rank holds every placeholder of every image it was sent
        assert all(tokens == PER_IMAGE * count for tokens, count in rank["image_tokens"])


def test_resume_with_images_repeats_the_uninterrupted_run(tmp_path):
    spec, _ = _corpus(tmp_path)
    spec = {**spec, "epochs": 0, "steps": 40, "snapshot_every": 10}
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}) as job:
        collect(start_ranks(job, 2, tmp_path, max_steps=17))
    with omniload.Job({**spec, "resume": str(folder)}) as job:
        resumed = collect(start_ranks(job, 2, tmp_path))
    start = resumed[0]["steps"][0]
    assert 0 < start <= 17
    for rank in range(2):  # the hashes cover every tensor, pixel_values and image_index included
        assert resumed[rank]["hashes"] == reference[rank]["hashes"][start:], f"rank {rank} differs after resume"


def test_resume_on_more_ranks_delivers_every_image_sample_once(tmp_path):
    spec, written = _corpus(tmp_path)
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}) as job:
        first = collect(start_ranks(job, 2, tmp_path, max_steps=6))
    with omniload.Job({**spec, "resume": str(folder)}) as job:
        second = collect(start_ranks(job, 3, tmp_path))
    seen, samples = _images_by_sample(first + second)
    assert set(samples.values()) == {1} and len(samples) == 70 + 50 + 80
    for source, data in written.items():
        for ordinal, (_, images) in enumerate(data):
            assert seen.get((source, ordinal), []) == [image_color(ordinal, k) for k in range(len(images))]


@pytest.mark.parametrize("on_bad_file", ["skip", "stop"])
def test_a_corrupt_image_skips_its_sample_or_stops_naming_it(tmp_path, on_bad_file):
    samples = [(f"caption {i}", [encoded_image(image_color(i, 0), (20, 10))]) for i in range(30)]
    write_image_tar(tmp_path / "bad.tar", samples, corrupt={7})
    spec = {
        "sources": [f"wds={tmp_path}/bad.tar"],
        "seq_len": 64,
        "rows": 2,
        "image_size": "8x8",
        "image_token": TOKEN,
        "on_bad_file": on_bad_file,
    }
    if on_bad_file == "stop":
        with omniload.Job(spec) as job, pytest.raises(omniload.OmniloadError) as failed:
            for _ in omniload.connect(job.addr, job.token, rank=0, world_size=1):
                pass
        assert "bad.tar" in str(failed.value) and "image 0 cannot be decoded" in str(failed.value)
        assert "--on-bad-file skip" in str(failed.value)
        return
    with omniload.Job(spec) as job:
        (rank,) = collect(start_ranks(job, 1, tmp_path))
        log = "\n".join(job.log_tail())
    _, delivered = _images_by_sample([rank])
    assert sorted(ordinal for _, ordinal in delivered) == [i for i in range(30) if i != 7]
    assert "skipped a sample" in log and "image 0 cannot be decoded" in log


def test_a_job_with_images_needs_an_image_token(tmp_path):
    write_image_tar(tmp_path / "a.tar", image_samples(3, 5))
    with pytest.raises(omniload.ConfigError, match="has images: give --image-token"):
        omniload.Job({"sources": [f"a={tmp_path}/a.tar"]}).start()
