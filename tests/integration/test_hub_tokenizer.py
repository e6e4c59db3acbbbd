"""--tokenizer ORG/NAME: a Hugging Face Hub model's tokenizer.json and chat template, fetched once
by the coordinator through huggingface_hub's cache (a fake Hub endpoint on loopback here, never
the network), give the batches its local files give; HF_TOKEN, HF_HUB_OFFLINE and a missing or
gated model behave as a user expects, with errors that say what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omniload.order import split_sample_id
from tests.fake_hub import FakeHub, serve_hub
from tests.jobs import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORDS = [f"w{i}" for i in range(40)]
# Meta-Llama-3-8B-Instruct's template (as tests/unit/test_chat.py)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _model_files(tmp_path) -> dict[str, bytes]:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "system": 3} | {w: 4 + i for i, w in enumerate(WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    local = tmp_path / "local-model"
    local.mkdir()
    tokenizer.save(str(local / "tokenizer.json"))
    config = {"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (local / "tokenizer_config.json").write_text(json.dumps(config))
    return {name: (local / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}


def _chat_file(tmp_path) -> str:
    lines = []
    for i in range(30):
        chat = [{"role": "system", "content": "w1 w2"}] if i % 3 == 0 else []
        for turn in range(1 + i % 2):
            chat.append({"role": "user", "content": " ".join(WORDS[(i + turn + k) % 40] for k in range(5))})
            chat.append({"role": "assistant", "content": " ".join(WORDS[(3 * i + turn + k) % 40] for k in range(4))})
        lines.append(json.dumps({"messages": chat}))
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_hub_model_id_gives_the_batches_its_local_files_give_and_is_fetched_once(tmp_path, monkeypatch):
    files = _model_files(tmp_path)
    spec = {
        "sources": [{"name": "sft", "path": _chat_file(tmp_path), "kind": "chat"}],
        "seq_len": 64,
        "rows": 2,
        "workers": 2,
        "seed": 3,
    }
    local = run_ranks(
        {**spec, "tokenizer": str(tmp_path / "local-model" / "tokenizer.json")}, 1, tmp_path, env={"PROBE_LABELS": "1"}
    )[0]
    hub = FakeHub({"tiny-org/tiny-chat": files}, gated={"tiny-org/tiny-chat": "hf_secret"})
    with serve_hub(hub):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        fetched = run_ranks({**spec, "tokenizer": "tiny-org/tiny-chat"}, 1, tmp_path, env={"PROBE_LABELS": "1"})[0]
    assert fetched["step_labels"] == local["step_labels"] and fetched["hashes"] == local["hashes"]
    assert {split_sample_id(sid)[1] for step in local["step_labels"] for sid, *_ in step if sid >= 0} == set(range(30))
    gets = [path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path]
    assert sorted(gets) == [
        "/tiny-org/tiny-chat/resolve/main/tokenizer.json",
        "/tiny-org/tiny-chat/resolve/main/tokenizer_config.json",
    ], "each file is downloaded once, by the coordinator: the workers read the Hub's cache"
    assert all(auth == "Bearer hf_secret" for _, path, auth in hub.requests if "/resolve/" in path)


def _fetch(name: str, env: dict[str, str]) -> str:
    """What fetching `name` gives in a fresh process (huggingface_hub reads HF_* when imported):
    the local path, or the ConfigError's message."""
    code = (
        "from omniload.errors import ConfigError\n"
        "from omniload.workers.hub_tokenizer import fetch_tokenizer\n"
        f"try:\n    print(fetch_tokenizer({name!r}))\nexcept ConfigError as exc:\n    print('ConfigError:', exc)\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_missing_gated_or_offline_model_is_an_error_that_says_what_to_do(tmp_path):
    files = _model_files(tmp_path)
    hub = FakeHub({"org/open": files, "org/gated": files}, gated={"org/gated": "hf_right"})
    with serve_hub(hub):
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
        assert "no such model on the Hugging Face Hub (a private one needs HF_TOKEN)" in _fetch("org/missing", env)
        gated = _fetch("org/gated", env)
        assert "the model is gated" in gated and "set HF_TOKEN" in gated
        assert _fetch("org/gated", {**env, "HF_TOKEN": "hf_right"}).endswith("tokenizer.json")
        assert "the model has no revision 'v9'" in _fetch("org/open@v9", env)
        offline = {**env, "HF_HUB_OFFLINE": "1"}
        message = _fetch("org/open", offline)
        assert "not in the Hugging Face cache" in message and "hf download org/open" in message
        online = _fetch("org/open", env)
        assert online.endswith("tokenizer.json") and os.path.isfile(online)
        asked = len(hub.requests)
    assert _fetch("org/open", offline) == online, "offline, the cache serves what was fetched, with the Hub gone"
    assert len(hub.requests) == asked
