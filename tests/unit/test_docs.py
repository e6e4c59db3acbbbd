"""docs/cli.md documents every flag the CLI has, and nothing else.

Convention (stated at the top of docs/cli.md): a flag is documented by a table row whose first
cell holds it in backticks (``| `--seq-len N` | ...``, several spellings in one cell:
``| `-q`, `--quiet` | ...``); the row applies to every command named as `` `omniload NAME` `` in
the `##` heading above it (`` `omniload` `` alone: the group's own options)."""

from __future__ import annotations

import re

import click

from omniload.cli import main
from omniload.cli_docs import CLI_MD

_HEADING_COMMAND = re.compile(r"`omniload(?: ([a-z-]+))?`")
_CODE = re.compile(r"`([^`]+)`")
_CELL_BORDER = re.compile(r"(?<!\\)\|")  # a pipe not escaped as \| (as in `stop\|skip`)


def cli_flags(group: click.Group) -> dict[str, set[str]]:
    """Per command ("" for the group itself) the flags its options accept, help excluded."""

    def flags(command: click.Command) -> set[str]:
        return {
            flag
            for param in command.params
            if isinstance(param, click.Option)
            for flag in (*param.opts, *param.secondary_opts)
        }

    found = {"": flags(group) | {"-h", "--help"}}
    for name, command in group.commands.items():
        found[name] = flags(command)
    return found


def documented_flags(text: str) -> dict[str, set[str]]:
    """Per command the flags docs/cli.md documents for it, by the convention above."""
    found: dict[str, set[str]] = {}
    commands: list[str] = []
    for line in text.splitlines():
        if line.startswith("## "):
            commands = [m.group(1) or "" for m in _HEADING_COMMAND.finditer(line)]
            continue
        if not line.startswith("| `-"):
            continue
        first_cell = _CELL_BORDER.split(line)[1]
        for code in _CODE.findall(first_cell):
            flag = code.split()[0]
            if flag.startswith("-"):
                for command in commands:
                    found.setdefault(command, set()).add(flag)
    return found


def test_every_cli_flag_is_documented_and_every_documented_flag_exists():
    actual = cli_flags(main)
    documented = documented_flags(CLI_MD.read_text())
    problems = []
    for command in sorted(actual.keys() | documented.keys()):
        label = f"omniload {command}".strip()
        if command not in actual:
            problems.append(f"docs/cli.md documents a command `{label}` that the CLI does not have")
            continue
        for flag in sorted(actual[command] - documented.get(command, set())):
            problems.append(f"`{label} {flag}` is not documented in docs/cli.md")
        for flag in sorted(documented.get(command, set()) - actual[command]):
            problems.append(f"docs/cli.md documents `{label} {flag}`, which the CLI does not have")
    assert not problems, "\n".join(problems)


def test_the_option_tables_are_made_from_the_specs_options():
    """docs/cli.md's job options are rendered from the Spec fields' Options (omniload.cli_docs),
    every group has its table, and each table is current."""
    from omniload.cli_docs import rewrite
    from omniload.spec import GROUPS

    text = CLI_MD.read_text()
    tables = set(re.findall(r"<!-- options: ([a-z ]+) -->", text))
    assert tables == {group for group, fields in GROUPS.items() if fields}, tables
    assert rewrite(text) == text, "docs/cli.md's option tables are out of date: python -m omniload.cli_docs"


def test_the_convention_is_parsed():
    text = (
        "## Job options: `omniload launch`, `omniload serve`\n| `--seq-len N` | 2048 |\n"
        "## `omniload launch`\n| `-q`, `--quiet` | off |\n| `--on-bad-file stop\\|skip` | stop |\n"
        "| not a flag | `--nope` |\n"
        "## Global options: `omniload`\n| `--version` | |\n"
    )
    assert documented_flags(text) == {
        "launch": {"--seq-len", "-q", "--quiet", "--on-bad-file"},
        "serve": {"--seq-len"},
        "": {"--version"},
    }
