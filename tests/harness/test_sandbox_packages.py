"""Candidates import the evaluator's packages wherever the evaluator's Python finds them, as a program
run in a fork of the evaluator (HF ``code_eval``, the paper's harness) does, or nothing is scored.

The case: the toolkit installed in a venv under a private folder (mode 700, such as /root) that the
throwaway user cannot enter. Before, the sandbox ran such candidates as the throwaway user with another
Python, without the evaluator's packages: ``import numpy`` failed and every answer using numpy scored 0.
The jail binds the folders the evaluator's Python needs, so the throwaway user runs them there too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from refusion_cli.harness.sandbox import isolation, package_folders, package_paths

ROOT = Path(__file__).resolve().parents[2]

# Run by the private venv's Python from the repository root: isolation() and two candidates, as JSON.
EVALUATOR = textwrap.dedent("""
    import json
    from refusion_cli.harness.sandbox import isolation, run_candidate

    found = isolation()
    numpy = run_candidate("import numpy as np\\nassert int(np.arange(4).sum()) == 6\\n", timeout=20)
    missing = run_candidate("import surely_not_an_installed_package\\n", timeout=20)
    print(json.dumps({"isolation": found.record(), "refused": found.throwaway_refused, "line": found.describe(),
                      "numpy": [numpy.passed, numpy.detail], "missing": [missing.passed, missing.detail]}))
""")


def private_venv(home: Path) -> Path:
    """A venv in `home` (mode 700) whose site-packages reaches the toolkit's packages through a .pth
    file, as an installation there would: only a user who can enter `home` imports them."""
    home.mkdir()
    home.chmod(0o700)
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site_packages = next(venv.glob("lib/python*/site-packages"))
    (site_packages / "toolkit.pth").write_text("".join(f"{folder}\n" for folder in package_folders()))
    return venv


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs candidates as a throwaway user, which a private "
                                               "folder keeps out; other users run them as themselves")
def test_a_toolkit_in_a_private_folder_gives_candidates_its_packages_as_a_fork_would(tmp_path):
    venv = private_venv(tmp_path / "home")
    ran = subprocess.run([str(venv / "bin" / "python"), "-c", EVALUATOR], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert seen["numpy"] == [True, ""]  # the paper's harness scores it 1; the throwaway user's Python scored it 0
    assert seen["missing"] == [False, "ModuleNotFoundError: No module named 'surely_not_an_installed_package'"]
    assert seen["isolation"]["packages"] and seen["isolation"]["interpreter"] == str(venv / "bin" / "python")
    assert seen["isolation"]["own_interpreter"]
    if isolation().jail:  # the jail binds the private folders the evaluator's Python needs, and nothing more
        assert seen["isolation"]["jail"] and seen["isolation"]["user"] == "throwaway" and seen["refused"] == ""
        return
    # without a jail the throwaway user cannot read the private site-packages: the evaluator's user and Python run
    # the candidate, and the sandbox says so
    assert seen["isolation"]["user"] == "evaluator"
    assert seen["refused"] and "the throwaway user could not run them" in seen["line"]


def test_the_package_paths_are_the_folders_and_what_their_pth_files_add():
    paths = package_paths()
    assert paths[0] == package_folders()[0] and set(package_folders()) <= set(paths)
    assert all(os.path.exists(path) for path in paths)
    assert isolation().packages  # this machine's candidates read every one of them


def test_candidates_import_what_a_fork_of_the_evaluator_imports():
    from refusion_cli.harness.sandbox import run_candidate

    result = run_candidate("import numpy, sympy\nprint(numpy.__file__)\n", timeout=20)
    assert result.passed, result.detail
    import numpy

    assert result.stdout.strip() == numpy.__file__
