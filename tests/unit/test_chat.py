"""Conversations (workers/chat.py): which tokens a chat template makes trained, checked by hand
for ChatML and for a Llama-3 template from a tokenizer_config.json; the labels a batch gets
from the mask; long conversations; bad rows named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omniload.batch_arrays import IGNORE_INDEX, trained_tokens
from omniload.coordinator.plan.packer import Segment, build_batch, compact_batch
from omniload.errors import ConfigError
from omniload.formats.lane_config import ChatConfig
from omniload.formats.shards import BadFile
from omniload.workers.chat import ChatError, ChatSample, chat_config, encode, jinja_render, parse_messages
from omniload.workers.readers import index_file, read_shard
from omniload.workers.transforms import load_transform

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "hello"},
]
# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _bytes(texts: list[str]) -> list[np.ndarray]:
    return load_transform("bytes")(texts)


def _trained_text(sample: ChatSample) -> list[str]:
    """The runs of trained tokens, decoded (bytes tokenizer)."""
    runs, current = [], bytearray()
    for token, trained in zip(sample.tokens.tolist(), sample.mask.tolist()):
        if trained:
            current.append(token)
        elif current:
            runs.append(current.decode())
            current = bytearray()
    return runs + ([current.decode()] if current else [])


def test_chatml_trains_exactly_each_reply_and_its_end_marker():
    (sample,) = encode([CONVERSATION], ChatConfig(seq_len=4096), _bytes, None)
    assert bytes(sample.tokens.tolist()).decode() == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"
        "<|im_start|>assistant\nhi there<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
    )
    assert _trained_text(sample) == ["hi there<|im_end|>", "hello<|im_end|>"]


def test_labels_are_ignored_everywhere_but_where_the_next_token_is_a_reply():
    (sample,) = encode([CONVERSATION], ChatConfig(seq_len=4096), _bytes, None)
    n = len(sample.tokens)
    segment = Segment(0, 1, n, sample.tokens, mask=sample.mask)
    text = Segment(1, 2, 5, np.arange(5, dtype=np.int32))
    batch = build_batch([[segment], [text]], seq_len=n + 3, masked=True)
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    expected = [int(ids[i + 1]) if i + 1 < n and sample.mask[i + 1] else IGNORE_INDEX for i in range(n + 3)]
    assert labels.tolist() == expected
    targets = bytes(t for t in labels.tolist() if t != IGNORE_INDEX).decode()
    assert targets == "hi there<|im_end|>hello<|im_end|>"
    assert batch["labels"][1].tolist()[:5] == [1, 2, 3, 4, IGNORE_INDEX], "a text segment trains on every token"
    wire = compact_batch([[segment], [text]], n + 3, masked=True)
    plain = compact_batch([[text]], n + 3)
    want = int((batch["labels"] != IGNORE_INDEX).sum()) + 4
    assert trained_tokens([wire, plain]) == want, "the loss's global count is the labels' count, mask included"


def test_a_job_without_conversations_sends_the_batch_it_always_sent():
    rows = [[Segment(0, 1, 4, np.arange(4, dtype=np.int32))]]
    plain = compact_batch(rows, 6)
    assert "label_mask" not in plain
    masked = compact_batch(rows, 6, masked=True)
    assert set(masked) - set(plain) == {"label_mask"} and all((masked[k] == plain[k]).all() for k in plain)
    assert np.unpackbits(masked["label_mask"], count=6).tolist() == [1, 1, 1, 1, 0, 0]


@pytest.fixture
def llama3_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "hello": 3, "world": 4, "hi": 5, "there": 6}
    vocab |= {"system": 7, "Be": 8, "brief": 9, ".": 10, "again": 11}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer.add_special_tokens(specials)  # ids 12, 13, 14, 15
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path / "tokenizer.json")


def test_a_llama3_template_from_tokenizer_config_trains_each_reply_and_its_eot(llama3_tokenizer):
    config = chat_config(llama3_tokenizer, 4096, "assistant", False)
    assert config.template == LLAMA3 and (config.bos, config.eos) == ("<|begin_of_text|>", "<|eot_id|>")
    conversation = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": " hi there\n"}]
    (sample,) = encode([conversation], config, load_transform(llama3_tokenizer), jinja_render(config))
    bos, start, end, eot = 12, 13, 14, 15
    # <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello world<|eot_id|>
    # <|start_header_id|>assistant<|end_header_id|>\n\nhi there<|eot_id|>   (| trim strips the reply)
    assert sample.tokens.tolist() == [bos, start, 1, end, 3, 4, eot, start, 2, end, 5, 6, eot]
    assert sample.mask.tolist() == [0] * 10 + [1, 1, 1]


def test_sharegpt_conversations_map_human_and_gpt():
    sharegpt = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "yo"},
    ]
    assert parse_messages(sharegpt) == parse_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    )


@pytest.mark.parametrize(
    "value, message",
    [
        ([{"role": "robot", "content": "beep"}], "message 0 has role 'robot'; expected one of system, user"),
        ([{"from": "bard", "value": "x"}], "message 0 is from 'bard'; expected one of human, gpt"),
        ([], "has no messages"),
        (None, "has no messages"),
        ([{"role": "user", "content": "a"}, "text"], "message 1 is 'text', not a mapping"),
        ([{"role": "user", "content": {"x": 1}}], "message 0 has content"),
        ([{"speaker": "user"}], "message 0 has neither 'role' nor 'from'"),
    ],
)
def test_bad_conversations_say_which_message_is_wrong(value, message):
    (result,) = encode([value], ChatConfig(seq_len=64), _bytes, None)
    assert isinstance(result, ChatError) and message in str(result)


def test_train_on_all_trains_every_token():
    (sample,) = encode([CONVERSATION], ChatConfig(seq_len=4096, train_on="all"), _bytes, None)
    assert sample.mask.all()


def test_a_long_conversation_is_cut_after_the_last_whole_reply_that_fits_or_dropped():
    turn = len("<|im_start|>assistant\nhi there<|im_end|>\n")
    head = len("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n")
    whole = head + turn + len("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
    (cut,) = encode([CONVERSATION], ChatConfig(seq_len=whole - 1), _bytes, None)
    assert cut.truncated and len(cut.tokens) == head + turn  # the user turn after the reply fits, but trains nothing
    assert _trained_text(cut) == ["hi there<|im_end|>"]
    assert encode([CONVERSATION], ChatConfig(seq_len=whole - 1, drop_long=True), _bytes, None) == [whole]
    assert encode([CONVERSATION], ChatConfig(seq_len=head + turn - 1), _bytes, None) == [whole], "no reply fits"
    (fits,) = encode([CONVERSATION], ChatConfig(seq_len=whole), _bytes, None)
    assert not fits.truncated and len(fits.tokens) == whole


def test_a_template_that_rewrites_earlier_turns_is_refused():
    config = ChatConfig(
        seq_len=64, template="{{ messages | length }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (result,) = encode([CONVERSATION[1:3]], config, _bytes, jinja_render(config))
    assert isinstance(result, ChatError) and "renders message 1 by changing what it rendered" in str(result)


def test_a_template_that_does_not_compile_is_a_config_error_naming_the_tokenizer(tmp_path, llama3_tokenizer):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ConfigError, match="the chat template of .*tokenizer.json' does not compile"):
        chat_config(llama3_tokenizer, 64, "assistant", False)


def test_a_row_without_messages_is_a_bad_file_naming_its_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": CONVERSATION}, {"conversations": [{"from": "human", "value": "x"}]}, {"text": "oops"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (shard,) = index_file(str(path), "jsonl", "messages|conversations", 0, values="chat")
    with pytest.raises(BadFile, match="line 3 has no key 'messages' or 'conversations'"):
        read_shard(shard, "messages|conversations")
    path.write_text(json.dumps({"messages": "hi"}) + "\n")
    with pytest.raises(BadFile, match="kind=chat needs a list of messages"):
        index_file(str(path), "jsonl", "messages|conversations", 0, values="chat")


def test_parquet_conversations_are_read_from_messages_or_conversations(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]]}),
        tmp_path / "c.parquet",
    )
    (shard,) = index_file(str(tmp_path / "c.parquet"), "parquet", "messages|conversations", 0, values="chat")
    (value,) = read_shard(shard, "messages|conversations")
    assert parse_messages(value)[1].content == "yo"
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(BadFile, match="no column 'messages' or 'conversations'"):
        index_file(str(tmp_path / "t.parquet"), "parquet", "messages|conversations", 0, values="chat")


# Qwen2-Instruct's tokenizer_config.json chat_template: a default system prompt when none is given
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_qwen2_template_trains_the_replies_not_its_default_system_prompt():
    config = ChatConfig(seq_len=4096, template=QWEN2)
    (sample,) = encode([CONVERSATION[1:]], config, _bytes, jinja_render(config))
    assert bytes(sample.tokens.tolist()).decode().startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert _trained_text(sample) == ["hi there<|im_end|>", "hello<|im_end|>"]


@pytest.mark.parametrize("reply", ["end", "im", "|>", "assistant"])
def test_a_reply_that_also_occurs_in_the_template_text_is_found_where_the_reply_is(reply):
    """With a Qwen2 (ChatML) template, a reply "end" also occurs inside "<|im_end|>"."""
    config = ChatConfig(seq_len=4096, template=QWEN2)
    conversation = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": reply}]
    (sample,) = encode([conversation], config, _bytes, jinja_render(config))
    assert bytes(sample.tokens.tolist()).decode().endswith(f"<|im_start|>assistant\n{reply}<|im_end|>\n")
    assert _trained_text(sample) == [f"{reply}<|im_end|>"]


def test_a_conversation_that_renders_to_nothing_is_a_bad_sample():
    config = ChatConfig(seq_len=64, template="{% for message in messages %}{% endfor %}")
    (result,) = encode([CONVERSATION[1:2]], config, _bytes, jinja_render(config))
    assert isinstance(result, ChatError) and "renders to no tokens" in str(result)


def test_status_shows_the_long_conversations_of_each_source():
    from omniload.status_view import render

    source = {
        "name": "sft",
        "docs_per_s": 1.0,
        "tokens_per_s": 10,
        "ring_fill": 0.5,
        "workers": 1,
        "worker_cpu_percent": 1.0,
        "restarts": 0,
        "epoch": 0,
        "cursor": [0, 0],
        "chats_truncated": 7,
        "chats_dropped": 2,
    }
    status = {
        "job": "j",
        "uptime_s": 1,
        "steps": {"planned": 1, "slowest": 0, "final": None},
        "delivered": {"tokens_per_s": 1},
        "planner": {"steps": 0},
        "sources": [source, {**source, "name": "web", "chats_truncated": 0, "chats_dropped": 0}],
        "ranks": [],
        "waiting_for": None,
    }
    lines = render(status).splitlines()
    at = lines.index(next(line for line in lines if line.startswith("long chats")))
    assert lines[at + 1].split() == ["sft", "7", "2"] and not lines[at + 2].startswith("web")
