"""The coordinator and workers must not import torch (hundreds of MB per process); a rank's
`import omniload` must not import the coordinator's dependencies."""

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_coordinator_and_workers_do_not_import_torch():
    modules = _modules_after(
        "import omniload.coordinator.server, omniload.coordinator.__main__, omniload.workers.worker, omniload.job"
    )
    assert "torch" not in modules


def test_a_rank_imports_torch_but_not_the_coordinator_stack():
    modules = _modules_after("import omniload\nomniload.connect")
    assert "torch" in modules
    assert not {"uvloop", "pyarrow", "click", "omniload.coordinator"} & modules


def test_the_coordinator_does_not_import_pyarrow():
    """About 30 MB a process: only the workers and the indexing child (catalog.py) read files."""
    modules = _modules_after("import omniload.coordinator.server, omniload.coordinator.__main__, omniload.cli")
    assert "pyarrow" not in modules
