import dataclasses

import pytest

from omniload import cli
from omniload.cli import build_spec
from omniload.errors import ConfigError
from omniload.spec import GROUPS, Spec, parse_source


def test_source_flag_syntax():
    s = parse_source("code=data/code/*.jsonl,weight=0.3,column=content")
    assert (s.name, s.path, s.weight, s.column) == ("code", ("data/code/*.jsonl",), 0.3, "content")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"sources": []}, "no sources"),
        ({"sources": ["a=x,weight=-1"]}, "source 'a': weight must be >= 0, got -1.0"),
        ({"sources": ["a=x,weight=0", "b=y,weight=0"]}, "weights are all zero"),
        ({"sources": ["a=x"], "seq_len": 1}, "seq-len must be an integer >= 2, got 1"),
        ({"sources": ["a=x"], "seq_len": "many"}, "seq-len must be a number, got 'many'"),
        ({"sources": ["a=x"], "colour": 1}, "unknown option.*colour"),
        ({"sources": ["a=x,colour=red"]}, "source 'a'.*unknown option.*colour"),
        ({"sources": ["justaglob"]}, "expected NAME=GLOB"),
        ({"sources": ["a=x", "a=y"]}, "repeated: a"),
        ({"sources": ["a=x"], "on_bad_file": "ignore"}, "on-bad-file must be one of"),
    ],
)
def test_bad_specs_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        Spec.from_dict(data)


def test_round_trip_through_a_dict():
    spec = Spec.from_dict({"sources": ["a=x/*.parquet,weight=2", "b=y/*.jsonl"], "seq_len": 64, "tp": 2})
    assert Spec.from_dict(spec.to_dict()) == spec
    assert spec.weights() == pytest.approx([2 / 3, 1 / 3])


def test_fingerprint_follows_data_not_runtime_knobs():
    from omniload.coordinator.pool.catalog import fingerprint, job_identity

    base = {"sources": ["a=x"], "seq_len": 64}
    a = fingerprint(job_identity(Spec.from_dict(base), []))
    runtime = {"workers": 9, "ring_mb": 4, "checkpoint_dir": "/tmp/x", "resume": "/tmp/y", "broadcast_at": "tp"}
    assert fingerprint(job_identity(Spec.from_dict({**base, **runtime}), [])) == a
    assert fingerprint(job_identity(Spec.from_dict({**base, "seed": 1}), [])) != a


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        "seq-len: 512\nrows: 2\nsources:\n  - name: web\n    path: w/*.parquet\n    weight: 0.5\n"
        "  - code=c/*.jsonl,column=content\n"
    )
    spec = build_spec(str(config), (), {"rows": 8, "seq_len": None})
    assert (spec.seq_len, spec.rows) == (512, 8)
    assert [s.name for s in spec.sources] == ["web", "code"] and spec.sources[1].column == "content"
    spec = build_spec(str(config), ("books=b/*.arrow",), {})
    assert [s.name for s in spec.sources] == ["books"]


def test_every_option_is_in_one_group_and_a_grouped_file_is_the_flat_one(tmp_path):
    grouped = [f for fields in GROUPS.values() for f in fields]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(Spec) if f.name != "sources")
    config = tmp_path / "job.yaml"
    config.write_text(
        "sources: [web=w/*.parquet]\nbatching: {seq-len: 512, rows: 2}\nplan:\n  seed: 7\n"
        "  mixture: [{weights: {web: 1}, until_step: 9}]\nworkers: {workers: 3, ring_mb: 8}\nparallel: {tp: 2}\n"
    )
    flat = {"sources": ["web=w/*.parquet"], "seq_len": 512, "rows": 2, "seed": 7, "workers": 3, "ring_mb": 8}
    flat["mixture"], flat["tp"] = [{"weights": {"web": 1}, "until_step": 9}], 2
    assert build_spec(str(config), (), {}) == Spec.from_dict(flat)
    assert build_spec(str(config), (), {"rows": 8}).rows == 8  # a flag overrides a grouped option


@pytest.mark.parametrize(
    "data, message",
    [
        ({"batching": {"seq_len": 64}, "seq_len": 32}, "'seq_len' is given twice"),
        ({"batching": {"seqlen": 64}}, "group 'batching': unknown option.*seqlen"),
        ({"plan": {"rows": 2}}, "group 'plan': 'rows' belongs in group 'batching'"),
        ({"batching": 4096}, "group 'batching' must be a mapping"),
    ],
)
def test_misplaced_grouped_options_name_the_group(data, message):
    with pytest.raises(ConfigError, match=message):
        Spec.from_dict({"sources": ["a=x"], **data})


def test_unreadable_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file"):
        build_spec(str(tmp_path / "missing.yaml"), (), {})
    (tmp_path / "bad.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        build_spec(str(tmp_path / "bad.yaml"), (), {})


def test_the_shuffle_horizon_is_the_jobs_split_by_weight():
    spec = Spec.from_dict({"sources": [{"name": "a", "path": "x"}], "seq_len": 1024, "rows": 2})
    assert spec.shuffle_horizon(dp=2, share=1.0) == (1 << 28, 1 << 27)  # 2**28 tokens, filled 2**27 first
    assert spec.shuffle_horizon(dp=2, share=0.25) == (1 << 26, 1 << 25)
    batch = 4096 * 2 * 1024
    assert spec.shuffle_horizon(dp=4096, share=1.0) == (64 * batch, 16 * batch)  # at least 64 and 16 global batches
    fixed = Spec.from_dict({"sources": [{"name": "a", "path": "x"}], "seq_len": 1024, "shuffle_window": 10})
    assert fixed.shuffle_horizon(dp=8, share=0.01) == (103, 103)  # segments of seq_len tokens, filled whole
    small_fill = Spec.from_dict({"sources": [{"name": "a", "path": "x"}], "seq_len": 1024, "shuffle_fill": 8})
    assert small_fill.shuffle_horizon(dp=2, share=0.5) == (1 << 27, 4096)  # --shuffle-fill, its share
    with pytest.raises(ConfigError, match="max-doc-share must be in"):
        Spec.from_dict({"sources": [{"name": "a", "path": "x"}], "max_doc_share": 0})


@pytest.mark.parametrize(
    "source, message",
    [
        ("a=x.bin,format=tokens", "format=tokens needs eos=ID"),
        ("a=x.bin,format=tokens,eos=5,dtype=float32", "dtype must be one of"),
        ("a=x.parquet,eos=5", "eos= and dtype= describe a flat token file: give format=tokens"),
        ("a=x.parquet,vocab=100", "vocab= checks the ids of a source of token ids"),
        ("a=x.bin,format=tokens,eos=100,vocab=100", "eos=100 is not below vocab=100"),
        ("a=x.bin,format=megatron,tokens=ids", "tokens= names a column of token-id lists"),
        ("a=x.parquet,tokens=ids,vocab=0", "vocab must be the vocabulary size"),
    ],
)
def test_bad_token_source_options_name_the_source_and_the_fix(source, message):
    with pytest.raises(ConfigError, match=f"source 'a': .*{message}"):
        Spec.from_dict({"sources": [source]})


def test_token_sources_from_flags_yaml_and_python_alike(tmp_path):
    flag = parse_source("web=data/*.bin,format=tokens,eos=50256,vocab=50304,dtype=uint16")
    config = tmp_path / "job.yaml"
    config.write_text("sources:\n  - {name: web, path: data/*.bin, format: tokens, eos: 50256, vocab: 50304}\n")
    from_yaml = build_spec(str(config), (), {}).sources[0]
    python = parse_source({"name": "web", "path": "data/*.bin", "format": "tokens", "eos": 50256, "vocab": 50304})
    assert flag == from_yaml == python and flag.holds_tokens
    column = parse_source("ids=x/*.parquet,tokens=input_ids")
    assert column.holds_tokens and column.read_column == "input_ids"
    assert parse_source("m=x/*.bin").holds_tokens and not parse_source("t=x/*.parquet").holds_tokens


def test_a_text_source_keeps_the_fingerprint_it_had_before_token_sources():
    from omniload.coordinator.pool.catalog import fingerprint, job_identity

    spec = Spec.from_dict({"sources": ["a=x"], "seq_len": 64})
    identity = job_identity(spec, [])
    assert "tokens" not in identity["spec"]["sources"][0] and "vocab" not in identity["spec"]["sources"][0]
    tokens = Spec.from_dict({"sources": ["a=x,tokens=ids"], "seq_len": 64})
    assert fingerprint(identity) != fingerprint(job_identity(tokens, []))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"sources": ["a=x.jsonl,kind=dialog"]}, "source 'a': kind must be one of"),
        ({"sources": ["a=x.jsonl,train_on=all"]}, "source 'a': train_on= says which turns .* give kind=chat"),
        ({"sources": ["a=x.jsonl,kind=chat,train_on=user"]}, "source 'a': train_on must be one of"),
        ({"sources": ["a=x.bin,kind=chat"]}, "source 'a': kind=chat reads conversations from JSON lines"),
        ({"sources": ["a=x.parquet,kind=chat,tokens=ids"]}, "source 'a': kind=chat reads conversations"),
        ({"sources": ["a=x.jsonl,kind=chat"], "long_chats": "split"}, "long-chats must be one of"),
    ],
)
def test_bad_chat_options_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        Spec.from_dict(data)


def test_chat_sources_read_messages_or_conversations_and_only_they_change_the_fingerprint():
    from omniload.coordinator.pool.catalog import fingerprint, job_identity

    chat = parse_source("sft=x/*.jsonl,kind=chat")
    assert chat.read_column == "messages|conversations"
    assert parse_source("sft=x/*.jsonl,kind=chat,column=dialog").read_column == "dialog"
    text = Spec.from_dict({"sources": ["a=x"], "seq_len": 64})
    assert "long_chats" not in job_identity(text, [])["spec"]
    assert fingerprint(job_identity(text, [])) == fingerprint(
        job_identity(Spec.from_dict({"sources": ["a=x"], "seq_len": 64, "long_chats": "drop"}), [])
    ), "--long-chats decides nothing in a job without conversations"
    with_chat = Spec.from_dict({"sources": ["a=x,kind=chat"], "seq_len": 64})
    assert with_chat.masks_labels and not Spec.from_dict({"sources": ["a=x,kind=chat,train_on=all"]}).masks_labels
    assert job_identity(with_chat, [])["spec"]["long_chats"] == "truncate"


def test_variable_rank_tokens_are_checked_and_keep_old_identities():
    from omniload.coordinator.pool.catalog import fingerprint, job_identity

    base = {"sources": ["a=x"], "seq_len": 64, "rows": 2}
    spec = Spec.from_dict({**base, "rank_tokens": "variable"})
    assert spec.rank_token_cap == 256  # 2 x rows x seq_len
    assert Spec.from_dict({**base, "rank_tokens": "variable", "max_rank_tokens": "200"}).rank_token_cap == 200
    with pytest.raises(ConfigError, match="max-rank-tokens 100 must be at least rows x seq-len = 128"):
        Spec.from_dict({**base, "max_rank_tokens": 100})
    with pytest.raises(ConfigError, match="rank-tokens must be one of"):
        Spec.from_dict({**base, "rank_tokens": "elastic"})
    with pytest.raises(ConfigError, match="cp > 1 needs the per-sequence context-parallel split"):
        Spec.from_dict({**base, "rank_tokens": "variable", "cp": 2, "cp_split": "row"})
    assert Spec.from_dict({**base, "rank_tokens": "variable", "cp": 2}).cp_split == "sequence"
    # a fixed job's checkpoints stay valid (the new fields decide nothing there); variable is another job
    plain = fingerprint(job_identity(Spec.from_dict(base), []))
    assert fingerprint(job_identity(Spec.from_dict({**base, "pad_to": 64}), [])) == plain
    assert fingerprint(job_identity(spec, [])) != plain


def test_budget_and_cost_model_options_from_a_config_file(tmp_path):
    from omniload.model_shape import PRESETS

    config = tmp_path / "job.yaml"
    config.write_text(
        "seq-len: 1024\nrows: 2\nrank-tokens: variable\nmax-rank-tokens: 4096\npad-to: 64\n"
        "cost-model: layers=16,hidden=2048,heads=32,ffn=8192,vocab=128256,kv_heads=8\n"
        "sources:\n  - web=w/*.parquet\n"
    )
    spec = build_spec(str(config), (), {"pad_to": None})
    assert (spec.rank_tokens, spec.rank_token_cap, spec.pad_to) == ("variable", 4096, 64)
    assert spec.cost_coeffs == PRESETS["llama-1b"].cost_coeffs()
    assert build_spec(str(config), (), {"rank_tokens": "fixed"}).rank_tokens == "fixed"  # flags win


@pytest.mark.parametrize(
    "given, message",
    [
        ({"sources": ["a=x,anonymous=ture"]}, "source 'a': anonymous must be true or false .*'ture'"),
        ({"sources": ["a=x"], "allow_changed_data": "maybe"}, "allow-changed-data must be true or false"),
        ({"sources": ["a=x"], "rows": 2.5}, "rows must be a number, got 2.5"),
        ({"sources": ["a=x"], "seq_len": "2k"}, "seq-len must be a number, got '2k'"),
    ],
)
def test_a_value_outside_its_options_type_is_an_error_naming_the_option(given, message):
    """Never coerced into something else: `anonymous=ture` was False, rows 2.5 was 2."""
    with pytest.raises(ConfigError, match=message):
        Spec.from_dict(given)


def test_yes_and_no_are_read_in_their_usual_spellings():
    for word, expected in (("true", True), ("Yes", True), ("1", True), ("off", False), ("FALSE", False)):
        source = Spec.from_dict({"sources": [f"a=s3://b/x,anonymous={word}"]}).sources[0]
        assert source.anonymous is expected


def test_a_manifest_is_for_a_stores_urls():
    with pytest.raises(ConfigError, match="source 'web': manifest= is for a store's URLs"):
        Spec.from_dict({"sources": [{"name": "web", "path": "data/*.parquet", "manifest": "web.manifest.npz"}]})
    spec = Spec.from_dict({"sources": ["web=s3://b/web/*.parquet,manifest=web.manifest.npz"]})
    assert spec.sources[0].manifest == "web.manifest.npz"


def test_launch_flags_give_the_spec_of_the_python_dict(monkeypatch):
    """What `omniload launch FLAGS -- CMD` runs is the job Python's dict describes: the
    integration tests of layouts and budgets start their jobs from dicts."""
    ran = {}
    monkeypatch.setattr(cli, "run_launch", lambda spec, cmd, **kwargs: ran.update(spec=spec, cmd=cmd) or 0)
    flags = ["--source=web=w/*.parquet,weight=0.6", "--source=code=c/*.jsonl,weight=0.4,column=content"]
    flags += ["--seq-len", "512", "--rows", "2", "--seed", "7", "--cost-coeffs", "1,64,0", "--rank-tokens", "variable"]
    flags += ["--pad-to", "16", "--tp", "2", "--cp", "2", "--broadcast-at", "tp", "--steps", "12", "--epochs", "0"]
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", *flags, "--workers", "3", "-q", "--", "torchrun", "train.py"], standalone_mode=False)
    assert exited.value.code == 0
    assert ran["spec"] == Spec.from_dict(
        {
            "sources": [
                {"name": "web", "path": "w/*.parquet", "weight": 0.6},
                {"name": "code", "path": "c/*.jsonl", "weight": 0.4, "column": "content"},
            ],
            **{"seq_len": 512, "rows": 2, "seed": 7, "cost_coeffs": "1,64,0", "rank_tokens": "variable"},
            **{"pad_to": 16, "tp": 2, "cp": 2, "broadcast_at": "tp", "steps": 12, "epochs": 0, "workers": 3},
        }
    )
    assert ran["cmd"] == ["torchrun", "train.py"]
