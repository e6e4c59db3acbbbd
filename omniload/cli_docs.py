"""How the job's options read in `--help` and in docs/cli.md, both from their one table,
omniload.spec_options.OPTIONS.

`python -m omniload.cli_docs` rewrites docs/cli.md's option tables, each between the lines
`<!-- options: GROUP -->` and `<!-- end options -->`; tests/unit/test_docs.py fails while one
is out of date.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from omniload.spec import Spec
from omniload.spec_options import OPTIONS

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Spec) if f.name != "sources"}
_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")
_BLOCK = re.compile(r"(<!-- options: ([a-z ]+) -->\n).*?(<!-- end options -->)", re.S)

# The two job options that are no Spec field: their flag as docs/cli.md writes it, and help.
CONFIG_HELP = (
    "YAML/JSON file with the same options (`seq_len` or `seq-len`; `sources` as a list of mappings or of "
    "`NAME=GLOB,...` strings); flags override it."
)
SOURCE_HELP = (
    "A data source; repeat for several. Keys: `weight` (1.0), `column` (`text`), `format` (`auto`, `parquet`, "
    "`jsonl`, `arrow`, `tar`, `megatron`, `tokens`), `tokenizer` (the job's), `epochs` (the job's), `image` (the "
    "column of encoded images; see [images.md](images.md)); for token ids (see [sources.md](sources.md)) "
    "`tokens` (a column of token-id lists), `vocab` (ids must be below it), and for `format=tokens` `eos` (the "
    "id ending each document) and `dtype` (`uint16`); for conversations `kind` (`text`, `chat`) and `train_on` "
    "(`assistant`, `all`). GLOB may be a store URL (`s3://`, `gs://`, `az://`, `abfs://`, `hf://`); then also "
    "`endpoint`, `region`, `anonymous` (see [storage.md](storage.md)) and `manifest` (a file `omniload index` "
    "wrote: the source lists nothing)."
)
SOURCE_VALUE = "NAME=GLOB[,KEY=VALUE...]"
_NOT_FIELDS = {"data": [("--config FILE", CONFIG_HELP), (f"--source {SOURCE_VALUE}", SOURCE_HELP)]}


def plain(markdown: str) -> str:
    """Markdown as a terminal shows it: a link by its text, no backticks."""
    return _LINK.sub(r"\1", markdown).replace("`", "")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable that sets a job option when no flag does."""
    return f"OMNILOAD_{name.upper()}"


def value_of(name: str) -> str:
    """What the flag takes, as --help and the docs name it ('' for an on/off flag)."""
    spec_option = OPTIONS[name]
    return "|".join(spec_option.choices) or spec_option.metavar


def default_of(name: str) -> str:
    """The default in markdown: a word in backticks, a number bare."""
    value = _DEFAULTS[name]
    if OPTIONS[name].shown_default:
        return OPTIONS[name].shown_default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if OPTIONS[name].in_bytes and isinstance(value, int):
        return _bytes_text(value)
    return f"`{value}`" if isinstance(value, str) else str(value)


def _bytes_text(value: int) -> str:
    """64MB for 64 << 20: the largest unit that divides it (spec.parse_bytes reads it back)."""
    for unit, shift in (("TB", 40), ("GB", 30), ("MB", 20), ("KB", 10)):
        if value >= 1 << shift and not value % (1 << shift):
            return f"{value >> shift}{unit}"
    return str(value)


def table(group: str) -> str:
    """The markdown table of `group`'s flags, in OPTIONS' order."""
    rows = [("`" + cell + "`", "", help_) for cell, help_ in _NOT_FIELDS.get(group, [])]
    for name, spec_option in OPTIONS.items():
        if spec_option.group == group and spec_option.has_flag:
            cell = f"{flag_name(name)} {value_of(name)}".strip()
            rows.append((f"`{cell}`", default_of(name), spec_option.help))
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for cell, default, help_ in rows:
        cells = (cell.replace("|", "\\|"), default, help_)
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(lines) + "\n"


def rewrite(text: str) -> str:
    """docs/cli.md with every option table made anew from the Options."""
    return _BLOCK.sub(lambda m: f"{m.group(1)}\n{table(m.group(2))}\n{m.group(3)}", text)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else CLI_MD
    path.write_text(rewrite(path.read_text()))


if __name__ == "__main__":
    main()
