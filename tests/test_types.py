"""The package type-checks: mypy, configured in pyproject.toml ([tool.mypy]), finds nothing in refusion_cli.

Marked slow: from a cold cache (a fresh clone) the check takes half a minute, so `make check` runs it beside
`make test`, in CI too; `make test-all` runs it here."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_finds_no_errors_in_the_package():
    # the settings, the files and the cache folder (.mypy_cache, kept between runs) come from pyproject.toml
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
