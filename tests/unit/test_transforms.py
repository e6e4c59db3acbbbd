"""A tokenizer.json source's tokens are exactly the tokenizer's own: the workers encode in
batches without offsets (encode_batch_fast), which must not change a single id."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import tokenizers

from omniload.errors import ConfigError
from omniload.workers.transforms import load_transform, vocab_size

_TEXTS = [
    "def main():\n    return 42  # the answer",
    "Grüße aus Köln — naïve café, 東京, emoji 🙂 and tabs\tand  double  spaces",
    "",
    "<|endoftext|> is a special token here, written in the text",
    "x" * 3000,
]


def test_a_bpe_tokenizer_json_gives_the_tokenizers_own_ids(tmp_path):
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_TEXTS * 20, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    # token ids already made (a pre-tokenized value) pass through in place: the texts' ids
    # around them must stay in order
    given = np.array([7, 8, 9], dtype=np.int32)
    got = load_transform(str(path))([*_TEXTS[:2], given, *_TEXTS[2:]])
    want = [tokenizer.encode(text, add_special_tokens=False).ids for text in _TEXTS]
    assert [ids.tolist() for ids in got] == [*want[:2], [7, 8, 9], *want[2:]]
    assert all(ids.dtype == np.uint16 for i, ids in enumerate(got) if i != 2)  # 400 ids fit uint16
    assert got[4][0] == tokenizer.token_to_id("<|endoftext|>")  # added tokens in the text stay one id


def test_a_tokenizer_json_is_parsed_once_a_process_for_its_transform_and_its_vocabulary(tmp_path):
    """The indexing child asks for both, and each parse of a large vocabulary costs the job's
    start time (0.06 s for a 32k BPE, more for larger ones): the vocabulary comes from the
    tokenizer already loaded, which the file's removal shows."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    load_transform(str(path))
    path.unlink()
    assert vocab_size(str(path)) == 4  # the added token counts


class _Panic(BaseException):
    """What the tokenizers library raises when its Rust code panics (pyo3's PanicException)."""


def test_a_tokenizer_that_panics_while_loading_is_a_config_error_naming_the_file(tmp_path, monkeypatch):
    """A panic is not an Exception: it must still reach the user as the file's fault (the
    indexing child names the source), and never end the forkserver that preloads the file."""

    def panic(path: str) -> None:
        raise _Panic("called `Option::unwrap()` on a `None` value")

    path = tmp_path / "panics.json"
    path.write_text("{}")
    library = types.SimpleNamespace(Tokenizer=types.SimpleNamespace(from_file=panic))
    monkeypatch.setitem(sys.modules, "tokenizers", library)
    with pytest.raises(ConfigError, match="panics.json' cannot be loaded: called `Option::unwrap"):
        load_transform(str(path))
