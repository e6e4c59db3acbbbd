"""The install ships every package, and the source tree resolves the names it installs."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder_of(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools looks for `package`: the longest mapped prefix, then the rest as folders."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[n:])
    return ROOT / Path(*parts)


def test_every_package_folder_is_listed_for_the_install():
    config = _setuptools()
    listed = set(config["packages"])
    mapped = {_folder_of(p, config["package-dir"]).resolve(): p for p in listed}
    folders = {
        init.parent.resolve()
        for top in ("omniload", "coordinator", "workers")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert folders - set(mapped) == set(), "package folders missing from [tool.setuptools] packages"
    assert all((folder / "__init__.py").is_file() for folder in mapped), "listed packages without a folder"


def test_the_source_tree_resolves_the_installed_names():
    """omniload/coordinator and omniload/workers link to the top-level folders (for mypy,
    editors and import-graph tools), the same folders the package-dir mapping installs."""
    package_dir = _setuptools()["package-dir"]
    for name in ("coordinator", "workers"):
        assert (ROOT / "omniload" / name).resolve() == (ROOT / package_dir[f"omniload.{name}"]).resolve()
