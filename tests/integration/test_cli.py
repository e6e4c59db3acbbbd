"""`omniload launch` as a user runs it: bad input gets one clear line and exit code 2."""

from __future__ import annotations

import sys

import pytest

from tests.corpus import write_jsonl, write_parquet
from tests.jobs import PROBE, omniload_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

OK = [sys.executable, "-c", "pass"]


@pytest.fixture
def web(tmp_path):
    write_parquet(tmp_path / "web" / "a.parquet", ["hello world"] * 20)
    return str(tmp_path / "web" / "*.parquet")


def _launch(*flags: str, cmd=OK, env=None):
    return omniload_cli("launch", *flags, "--", *cmd, env=env)


def _assert_bad_input(result, message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_no_files_match(tmp_path):
    _assert_bad_input(
        _launch("--source", f"web={tmp_path}/nothing/*.parquet"),
        f"source 'web': no files match '{tmp_path}/nothing/*.parquet'",
    )


def test_invalid_parquet_stops_by_default_and_is_skipped_on_request(tmp_path, web):
    (tmp_path / "web" / "broken.parquet").write_text("this is not parquet")
    result = _launch("--source", f"web={web}")
    _assert_bad_input(result, "broken.parquet: not a valid parquet file")
    assert "--on-bad-file skip" in result.stderr
    skipped = _launch("--source", f"web={web}", "--on-bad-file", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert "skipping" in skipped.stderr and "broken.parquet" in skipped.stderr


def test_invalid_json_lines(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    _assert_bad_input(_launch("--source", f"code={tmp_path}/bad.jsonl"), "line 1 is not valid JSON")


def test_missing_column(tmp_path, web):
    _assert_bad_input(_launch("--source", f"web={web},column=body"), "no column 'body' (columns: text)")
    write_jsonl(tmp_path / "c.jsonl", ["x"], column="content")
    _assert_bad_input(_launch("--source", f"code={tmp_path}/c.jsonl"), "line 1 has no key 'text'")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--source", "WEB,weight=-0.5"], "weight must be >= 0, got -0.5"),
        (["--source", "WEB,weight=0"], "weights are all zero"),
        (["--source", "WEB", "--seq-len", "1"], "seq-len must be an integer >= 2, got 1"),
        (["--source", "WEB", "--frobnicate", "3"], "No such option '--frobnicate'"),
        (["--source", "WEB,colour=red"], "unknown option(s) colour"),
        (["--source", "WEB", "--tokenizer", "no_such_module:encode"], "cannot import module 'no_such_module'"),
        (
            ["--source", "WEB", "--tokenizer", "missing/tokenizer.json"],
            "tokenizer file 'missing/tokenizer.json' does not exist",
        ),
    ],
)
def test_bad_flags(web, flags, message):
    flags = [f.replace("WEB", f"web={web}") for f in flags]
    _assert_bad_input(_launch(*flags), message)


def test_config_file_with_flag_override(tmp_path, web):
    config = tmp_path / "job.yaml"
    config.write_text(f"sources:\n  - web={web}\nseq_len: 1\n")
    _assert_bad_input(_launch("--config", str(config)), "seq-len must be an integer >= 2, got 1")
    assert _launch("--config", str(config), "--seq-len", "16").returncode == 0


def test_exit_code_of_the_command_is_propagated(web):
    result = _launch("--source", f"web={web}", cmd=[sys.executable, "-c", "import sys; sys.exit(3)"])
    assert result.returncode == 3, result.stderr


def test_world_size_not_divisible_by_the_layout(web, tmp_path):
    result = _launch(
        "--source",
        f"web={web}",
        "--tp",
        "4",
        cmd=[sys.executable, str(PROBE), str(tmp_path / "o")],
        env={"WORLD_SIZE": "6", "RANK": "0"},
    )
    assert result.returncode == 2, result.stderr
    # the rank's own traceback is the training script's; the launcher's line names the cause
    assert "omniload: world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4" in result.stderr


def test_ranks_get_the_address_and_token(web, tmp_path):
    out = tmp_path / "probe.json"
    result = _launch("--source", f"web={web}", "--seq-len", "8", cmd=[sys.executable, str(PROBE), str(out)])
    assert result.returncode == 0, result.stderr
    assert out.exists()
