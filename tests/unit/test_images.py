"""Images without processes: decoding, placeholders, readers, records, chunks, the batch, the cost."""

from __future__ import annotations

import dataclasses
import io
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload.batch_arrays import expand
from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.packer import Segment, compact_batch
from omniload.coordinator.plan.units import units_of
from omniload.errors import ConfigError
from omniload.formats.lane_config import ImageConfig
from omniload.formats.records import decode, doc_record, images_of, tokens_of
from omniload.formats.shards import BadFile
from omniload.spec import Spec
from omniload.workers import readers
from omniload.workers.images import load_image_transform, place_images, text_pieces
from omniload.workers.readers import index_file, iter_slices
from tests.corpus import encoded_image, image_samples, write_image_tar

PIL = pytest.importorskip("PIL.Image")
CONFIG = ImageConfig(height=8, width=8, token=999, tokens_per_image=3)


def test_resize_covers_and_crops_the_center_keeping_colours():
    image = PIL.new("RGB", (40, 10), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 10))  # left half red, right half blue
    out = io.BytesIO()
    image.save(out, format="PNG")
    pixels = load_image_transform(CONFIG)(out.getvalue())
    assert pixels.shape == (3, 8, 8) and pixels.dtype == np.uint8
    # scaled to 32x8 to cover 8x8, then the middle 8 columns: red left of the seam, blue right of it
    assert pixels[:, 4, 0].tolist() == [255, 0, 0] and pixels[:, 4, 7].tolist() == [0, 0, 255]


def test_a_jpeg_and_a_grey_png_decode_to_rgb():
    decode_image = load_image_transform(CONFIG)
    jpeg = decode_image(encoded_image((200, 100, 50), (300, 200), "JPEG"))
    assert np.abs(jpeg.astype(int) - np.array([200, 100, 50])[:, None, None]).max() <= 3
    grey = io.BytesIO()
    PIL.new("L", (5, 5), 77).save(grey, format="PNG")
    assert decode_image(grey.getvalue()).tolist() == np.full((3, 8, 8), 77).tolist()


def test_user_image_transform_must_return_the_image_size(monkeypatch):
    module = type(__import__("sys"))("user_images")
    module.wrong = lambda image: np.zeros((8, 8, 3), np.uint8)
    monkeypatch.setitem(__import__("sys").modules, "user_images", module)
    decode_image = load_image_transform(ImageConfig(8, 8, 1, 1, "user_images:wrong"))
    with pytest.raises(ValueError, match=r"returned uint8 \[8, 8, 3\]; expected uint8 \[3, 8, 8\]"):
        decode_image(encoded_image((1, 2, 3), (4, 4)))
    with pytest.raises(ConfigError, match="has no function 'absent'"):
        load_image_transform(ImageConfig(8, 8, 1, 1, "user_images:absent"))


def test_placeholders_go_where_the_markers_say_or_lead():
    tok = lambda text: np.frombuffer(text.encode(), np.uint8).astype(np.int32)  # noqa: E731
    ids, at = place_images([tok(p) for p in text_pieces("ab<image>c<image>")], 2, CONFIG)
    assert ids.tolist() == [97, 98, 999, 999, 999, 99, 999, 999, 999] and at.tolist() == [2, 6]
    ids, at = place_images([tok("xy")], 2, CONFIG)
    assert ids.tolist() == [999] * 6 + [120, 121] and at.tolist() == [0, 3]
    with pytest.raises(ValueError, match="1 <image> markers for 2 images"):
        place_images([tok(p) for p in text_pieces("a<image>b")], 2, CONFIG)


def test_record_round_trip_carries_tokens_starts_and_pixels():
    tokens = np.arange(7, dtype=np.int32)
    pixels = np.arange(2 * 3 * 8 * 8, dtype=np.uint8).reshape(2, 3, 8, 8)
    record = decode(b"".join(bytes(p) for p in doc_record(5, 6, 7, tokens, np.array([0, 4], np.int32), pixels)))
    assert (record.group, record.pos, record.ordinal, record.images) == (5, 6, 7, 2)
    assert tokens_of(record).tolist() == tokens.tolist()
    at, got = images_of(record, 8, 8)
    assert at.tolist() == [0, 4] and (got == pixels).all()
    assert decode(b"".join(bytes(p) for p in doc_record(1, 2, 3, tokens))).images == 0


def test_image_columns_of_every_shape_read_as_pairs(tmp_path):
    a, b = encoded_image((1, 1, 1), (4, 4)), encoded_image((2, 2, 2), (4, 4))
    kinds = {
        "binary": pa.array([a, None, b], pa.binary()),
        "struct": pa.array(
            [{"bytes": a, "path": "a"}, None, {"bytes": b, "path": None}],
            pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        ),
        "list": pa.array([[a], [], [b, a]], pa.list_(pa.binary())),
    }
    expected = {"binary": [[a], [], [b]], "struct": [[a], [], [b]], "list": [[a], [], [b, a]]}
    for kind, column in kinds.items():
        path = tmp_path / f"{kind}.parquet"
        pq.write_table(pa.table({"text": ["x", "y", "z"], "img": column}), path)
        (shard,) = index_file(str(path), "parquet", "text", 0, image="img")
        values = [v for part in iter_slices(shard, "text", 0, "img") for v in part]
        assert values == list(zip(["x", "y", "z"], expected[kind])), kind
    pq.write_table(pa.table({"text": ["x"], "img": ["not bytes"]}), tmp_path / "bad.parquet")
    with pytest.raises(BadFile, match="image column 'img' has type string"):
        index_file(str(tmp_path / "bad.parquet"), "parquet", "text", 0, image="img")
    with pytest.raises(BadFile, match="needs parquet or Arrow files"):
        index_file(str(tmp_path / "x.jsonl"), "jsonl", "text", 0, image="img")


def test_tar_samples_group_by_key_in_shards_that_resume_part_way(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "TAR_SHARD_ROWS", 4)
    samples = image_samples(10, 7)
    path = write_image_tar(tmp_path / "a.tar", samples)
    shards = index_file(str(path), "tar", "text", 0)
    assert [s.rows for s in shards] == [4, 4, 2] and [s.first_ordinal for s in shards] == [0, 4, 8]
    values = [v for shard in shards for part in iter_slices(shard, "text") for v in part]
    assert values == samples
    resumed = iter_slices(dataclasses.replace(shards[1], slice_rows=1), "text", first=2)
    assert [v for part in resumed for v in part] == samples[6:8]


def test_tar_text_from_json_and_a_sample_without_text(tmp_path):
    path = tmp_path / "j.tar"
    with tarfile.open(path, "w") as archive:
        for name, data in [
            ("k1.json", b'{"caption": "hi"}'),
            ("k1.jpg", encoded_image((9, 9, 9), (4, 4), "JPEG")),
            ("k2.png", encoded_image((1, 1, 1), (4, 4))),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    (shard,) = index_file(str(path), "tar", "caption", 0)
    with pytest.raises(BadFile, match="sample 'k2' has no k2.txt and no k2.json"):
        list(iter_slices(shard, "caption"))
    with pytest.raises(BadFile, match="k1.json has no key 'text'"):
        index_file(str(path), "tar", "text", 0)


def test_a_sample_longer_than_a_row_stays_whole_with_each_image_in_its_chunk():
    pixels = np.stack([np.full((3, 2, 2), k, np.uint8) for k in range(3)])
    doc = Doc(0, 5, np.arange(20, dtype=np.int32), image_at=np.array([0, 9, 17], np.int32), pixels=pixels)
    (unit,) = units_of(doc, seq_len=8, rows=4)
    assert [s.length for s in unit] == [8, 8, 4] and len({s.group for s in unit}) == 1
    assert [s.position_start for s in unit] == [0, 8, 16]
    assert [s.images[:, 0, 0, 0].tolist() for s in unit] == [[0], [1], [2]]
    with pytest.raises(ValueError, match="needs 3 rows of --seq-len 8 on one rank, more than --rows 2"):
        units_of(doc, seq_len=8, rows=2)


def test_batch_images_follow_their_placeholders_row_by_row():
    def segment(sid, length, colours):
        images = np.stack([np.full((3, 2, 2), c, np.uint8) for c in colours]) if colours else None
        return Segment(0, sid, length, np.ones(length, np.int32), images=images)

    rows = [[segment(1, 3, [10]), segment(2, 4, [])], [segment(3, 5, [20, 30])]]
    wire = compact_batch(rows, seq_len=8, image_hw=(2, 2))
    assert wire["pixel_values"][:, 0, 0, 0].tolist() == [10, 20, 30]
    assert wire["image_index"].tolist() == [0, 3, 3]  # segment 2 is row 0's padding
    batch = expand(wire)
    assert batch["pixel_values"] is wire["pixel_values"] and batch["image_index"] is wire["image_index"]
    empty = compact_batch([[segment(1, 3, [])]], seq_len=8, image_hw=(2, 2))
    assert empty["pixel_values"].shape == (0, 3, 2, 2)
    assert "pixel_values" not in compact_batch([[segment(1, 3, [])]], seq_len=8)  # text-only jobs unchanged


def test_cost_counts_images_and_spec_defaults(tmp_path):
    cost = cost_function("attention", (0.0, 1.0, 0.0, 100.0), ["a"])
    assert cost(np.array([10, 10]), np.zeros(2, int), np.array([0, 2])).tolist() == [10.0, 210.0]
    spec = Spec.from_dict({"sources": ["a=x.parquet"], "cost_coeffs": "1,2,3"})
    assert spec.cost_coeffs == (1.0, 2.0, 3.0, 256 * 24576.0)
    with pytest.raises(ConfigError, match="image-size must be HxW"):
        Spec.from_dict({"sources": ["a=x.tar"], "image_token": 5, "image_size": "big"})
    assert Spec.from_dict({"sources": ["a=x.parquet,image=img"], "image_token": 5, "image_size": "32x48"}).image_hw == (
        32,
        48,
    )
