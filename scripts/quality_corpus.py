"""Generated text for bench_quality's `docs` and `changelogs` sources: seeded, so every machine
writes the same corpus whatever it has installed.

The text imitates what those sources used to read from the machine (package documentation and
Debian changelogs): documents grouped by package, each package with its own vocabulary, names and
API, lengths heavy-tailed (lognormal, a few documents 30x the median), written in sorted path
order. So, as with the real files, a reader that takes documents in file order sees one package
at a time, and a model can learn both the shared structure (markup, changelog lines, licences)
and each package's words.

Only `random.Random(seed).random()` is used: Python guarantees its sequence for a given seed
across versions and platforms (its other methods may change), and no global RNG is touched.
"""

from __future__ import annotations

import math
import random

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "ba",
    "de",
    "fi",
    "go",
    "hu",
    "ja",
    "ke",
    "li",
    "mo",
    "nu",
    "pa",
    "qui",
    "re",
    "so",
    "tu",
    "ve",
    "xa",
    "ze",
    "an",
    "el",
    "in",
    "or",
    "un",
    "ist",
    "ark",
    "ent",
    "ion",
    "ble",
    "ter",
    "ful",
    "net",
    "ows",
)
_COMMON = (
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "for",
    "with",
    "that",
    "this",
    "it",
    "be",
    "on",
    "as",
    "by",
    "can",
    "when",
    "from",
    "or",
    "not",
    "are",
    "each",
    "all",
    "its",
    "one",
    "which",
    "an",
    "if",
    "you",
    "use",
    "returns",
    "default",
    "value",
    "file",
    "option",
    "see",
    "new",
    "now",
    "also",
)
_VERBS = (
    "reads",
    "writes",
    "returns",
    "builds",
    "loads",
    "parses",
    "checks",
    "opens",
    "sends",
    "stores",
    "creates",
    "removes",
    "updates",
    "converts",
    "supports",
    "handles",
    "raises",
    "accepts",
)
_DOC_NAMES = (
    "README.md",
    "CHANGES.rst",
    "docs/index.rst",
    "docs/usage.rst",
    "docs/api.rst",
    "docs/faq.md",
    "NOTES.txt",
    "CONTRIBUTING.md",
)
_LICENSE = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software "
    'and associated documentation files (the "Software"), to deal in the Software without '
    "restriction, including without limitation the rights to use, copy, modify, merge, publish, "
    "distribute, sublicense, and/or sell copies of the Software, subject to the following "
    "conditions:\n\nThe above copyright notice and this permission notice shall be included in all "
    'copies or substantial portions of the Software.\n\nTHE SOFTWARE IS PROVIDED "AS IS", WITHOUT '
    "WARRANTY OF ANY KIND, EXPRESS OR IMPLIED.\n"
)
_CHANGES = (
    "New upstream release.",
    "Bump Standards-Version to {n}.{m}.{k}, no changes needed.",
    "Fix FTBFS with gcc-{n}.",
    "debian/control: build-depend on {w}-dev.",
    "Update debian/copyright.",
    "Add patch to fix {w} {x} on {arch}.",
    "Drop {w}.patch, applied upstream.",
    "Refresh patches for {w} {n}.{m}.",
    "Use debhelper-compat {n}.",
    "Add autopkgtest for {w}.",
    "Fix typo in {w} manual page.",
    "Rebuild against {w} {n}.{m}.",
    "Team upload.",
    "{W} {x} now {v} the {y} file (Closes: #{bug}).",
    "Switch to dh-sequence-{w}.",
    "Remove obsolete {w} maintainer script.",
    "Install {w} {x} examples.",
)
_ARCHES = ("amd64", "arm64", "armhf", "i386", "ppc64el", "s390x", "riscv64", "mips64el")
_DISTS = ("unstable", "experimental", "bookworm", "bullseye", "trixie")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


class _Rng:
    """Draws from one `random.Random(seed).random()` stream (stable across Python versions)."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed).random

    def below(self, n: int) -> int:
        return min(int(self._random() * n), n - 1)

    def pick(self, items):
        return items[self.below(len(items))]

    def lognormal(self, median: float, sigma: float) -> float:
        u1, u2 = 1.0 - self._random(), self._random()  # Box-Muller, u1 in (0, 1]
        return median * math.exp(sigma * math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2))


def _word(rng: _Rng, syllables: int) -> str:
    return "".join(rng.pick(_SYLLABLES) for _ in range(syllables))


class _Package:
    """A package's name and vocabulary: what makes its documents like each other."""

    def __init__(self, rng: _Rng) -> None:
        self.name = _word(rng, 2 + rng.below(2))
        self.words = [_word(rng, 1 + rng.below(3)) for _ in range(40 + rng.below(40))]
        self.funcs = [f"{rng.pick(self.words)}_{rng.pick(self.words)}" for _ in range(6 + rng.below(10))]
        self.version = (rng.below(5), rng.below(20), rng.below(10))

    def sentence(self, rng: _Rng) -> str:
        words = [rng.pick(self.words) if rng.below(3) == 0 else rng.pick(_COMMON) for _ in range(5 + rng.below(14))]
        words.insert(rng.below(len(words)), rng.pick(_VERBS))
        if rng.below(4) == 0:
            words.insert(rng.below(len(words)), f"``{self.name}.{rng.pick(self.funcs)}()``")
        return " ".join(words).capitalize() + rng.pick((".", ".", ".", ":", "?"))


def _doc_text(rng: _Rng, pkg: _Package, doc_name: str, size: int) -> str:
    title = f"{pkg.name} {rng.pick(pkg.words)}"
    md = doc_name.endswith(".md")
    parts = [f"# {title}\n" if md else f"{title}\n{'=' * len(title)}\n"]
    length = len(parts[0])
    while length < size:
        kind = rng.below(10)
        if kind < 5:
            text = " ".join(pkg.sentence(rng) for _ in range(1 + rng.below(6))) + "\n"
        elif kind < 7:
            head = f"{rng.pick(pkg.words).capitalize()} {rng.pick(pkg.words)}"
            text = f"## {head}\n" if md else f"{head}\n{'-' * len(head)}\n"
        elif kind < 9:
            args = ", ".join(f"{rng.pick(pkg.words)}={rng.below(100)}" for _ in range(rng.below(4)))
            call = f"result = {pkg.name}.{rng.pick(pkg.funcs)}({args})"
            text = f"```python\nimport {pkg.name}\n\n{call}\n```\n" if md else f".. code-block:: python\n\n    {call}\n"
        else:
            text = "".join(f"- {pkg.sentence(rng)}\n" for _ in range(2 + rng.below(5)))
        parts.append(text + "\n")
        length += len(text) + 1
    return "".join(parts)


def docs(seed: int, packages: int, max_bytes: int, median: float = 1500, sigma: float = 1.2) -> list[tuple[str, str]]:
    """Package documentation: a few documents per package (README, usage, API, FAQ, LICENSE),
    as (path, text) in sorted path order; their sizes lognormal (`median` bytes, `sigma`)."""
    rng, out = _Rng(seed), []
    for p in range(packages):
        pkg = _Package(rng)
        names = sorted({rng.pick(_DOC_NAMES) for _ in range(1 + rng.below(6))})
        for doc_name in names:
            size = min(max_bytes, int(rng.lognormal(median, sigma)) + 64)
            out.append((f"{p:04d}-{pkg.name}/{doc_name}", _doc_text(rng, pkg, doc_name, size)[:max_bytes]))
        if rng.below(3) == 0:
            out.append(
                (
                    f"{p:04d}-{pkg.name}/LICENSE.txt",
                    f"Copyright (c) {2000 + rng.below(25)} {pkg.name} developers\n\n{_LICENSE}",
                )
            )
    return out


def changelogs(
    seed: int, packages: int, max_bytes: int, median_entries: float = 12, sigma: float = 1.1
) -> list[tuple[str, str]]:
    """Debian-style changelogs, newest entry first, one per package, in sorted path order; their
    entries lognormal (`median_entries`, `sigma`)."""
    rng, out = _Rng(seed), []
    maintainers = [
        f"{_word(rng, 2).capitalize()} {_word(rng, 3).capitalize()} <{_word(rng, 2)}@debian.org>" for _ in range(60)
    ]
    for p in range(packages):
        pkg = _Package(rng)
        major, minor, patch = pkg.version
        year, entries, parts, length = 2024, max(1, int(rng.lognormal(median_entries, sigma))), [], 0
        for _ in range(entries):
            items = []
            for _ in range(1 + rng.below(5)):
                line = rng.pick(_CHANGES).format(
                    n=1 + rng.below(13),
                    m=rng.below(10),
                    k=rng.below(10),
                    w=rng.pick(pkg.words),
                    W=rng.pick(pkg.words).capitalize(),
                    x=rng.pick(pkg.funcs),
                    y=rng.pick(pkg.words),
                    v=rng.pick(_VERBS),
                    arch=rng.pick(_ARCHES),
                    bug=100000 + rng.below(900000),
                )
                items.append(f"  * {line}\n")
            entry = (
                f"{pkg.name} ({major}.{minor}.{patch}-{1 + rng.below(3)}) {rng.pick(_DISTS)}; "
                f"urgency={rng.pick(('low', 'medium', 'medium', 'high'))}\n\n{''.join(items)}\n"
                f" -- {rng.pick(maintainers)}  {rng.pick(_DAYS)}, {1 + rng.below(28):02d} "
                f"{rng.pick(_MONTHS)} {year} {rng.below(24):02d}:{rng.below(60):02d}:00 +0000\n\n"
            )
            parts.append(entry)
            length += len(entry)
            if length >= max_bytes:
                break
            patch, year = (patch - 1, year) if patch else (rng.below(10), year - rng.below(2))
            if patch == 0 and minor:
                minor -= 1
        out.append((f"{p:05d}-{pkg.name}/changelog", "".join(parts)[:max_bytes]))
    return out
