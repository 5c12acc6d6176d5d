"""The architecture rules of pyproject.toml's [tool.importlinter]: the package's imports point down its layers
(command line, features, models, decoders and tasks, shared modules) and never into tools/, and a wrong
import makes import-linter fail naming the contract it breaks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = "refusion_cli's layers import only downwards"
NO_TOOLS = "the library never imports the maintainer scripts in tools/"
# lint-imports in a fresh interpreter of this venv: it reads ./pyproject.toml and imports the packages from the
# working directory (first on the path), writing no cache
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_contracts():
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{LAYERS} KEPT" in out.stdout and f"{NO_TOOLS} KEPT" in out.stdout
    assert "Contracts: 2 kept, 0 broken." in out.stdout


@pytest.mark.parametrize("module, wrong_import, contract, reported", [
    ("refusion_cli/decoding/stats.py", "from refusion_cli.cli import output", LAYERS,
     "refusion_cli.decoding.stats -> refusion_cli.cli.output"),  # a decoder reaching up to the command line
    ("refusion_cli/bench/report.py", "from refusion_cli.harness import suite", LAYERS,
     "refusion_cli.bench.report -> refusion_cli.harness.suite"),  # two features of one layer are independent
    ("refusion_cli/tasks/synthetic.py", "import tools.synthetic", NO_TOOLS,
     "refusion_cli.tasks.synthetic -> tools.synthetic"),  # the library leaning on a maintainer script
], ids=["decoding-imports-cli", "bench-imports-harness", "tasks-imports-tools"])
def test_a_wrong_import_in_a_copy_of_the_package_breaks_its_contract(module, wrong_import, contract, reported,
                                                                      tmp_path):
    skip = shutil.ignore_patterns("assets", "__pycache__")
    for package in ("refusion_cli", "tools"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=skip)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    source = tmp_path / module
    source.write_text(f"{source.read_text()}\n{wrong_import}\n")
    out = lint_imports(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{contract} BROKEN" in out.stdout and reported in out.stdout
