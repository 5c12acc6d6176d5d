"""The package type-checks: mypy, configured in pyproject.toml ([tool.mypy]), finds nothing in refusion_cli."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_errors_in_the_package():
    # the settings, the files and the cache folder (.mypy_cache, kept between runs) come from pyproject.toml
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
