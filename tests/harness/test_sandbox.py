"""The sandbox scores hostile candidates 0, keeps the evaluator's files, secrets and processes safe, and keeps working.

What a test needs from this machine (the jail, a network namespace, the throwaway user, a PID namespace)
is probed by `isolation()`; a test that needs what is missing is skipped with the reason. On a machine without
a jail, REFUSION_ALLOW_UNJAILED=1 runs them on the weaker isolation. test_jail.py has the hostile candidates
in the jail with the toolkit in a private folder, and the refusal where bwrap is missing.
"""

from __future__ import annotations

import os
import secrets
import socket
import textwrap

import pytest

from refusion_cli.harness.sandbox import OUTPUT_CHARS, isolation, network_isolation, run_candidate, run_many

HOSTILE_TIMEOUT = 2.0
SLACK = 3.0  # seconds of scheduling delay allowed on a loaded 2-core machine

needs_throwaway_user = pytest.mark.skipif(
    not isolation().throwaway_user,
    reason="candidates run as the evaluator's user here: " + (isolation().throwaway_refused or "it is not root")
)
needs_jail_or_throwaway_user = pytest.mark.skipif(
    not (isolation().jail or isolation().throwaway_user),
    reason="neither a jail nor the throwaway user here: " + isolation().describe()
)


def leftover_processes(marker: str) -> list[int]:
    """Pids of processes running `sleep <marker>`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if cmdline.read().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def test_a_correct_program_passes_and_its_output_is_captured():
    result = run_candidate("assert sum([1, 2]) == 3\nprint('ok')")
    assert (result.passed, result.status, result.detail, result.stdout) == (True, "passed", "", "ok\n")


def test_a_wrong_solution_fails_with_the_exception_as_detail():
    result = run_candidate("def add(a, b):\n    return a - b\n\nassert add(2, 2) == 4\n")
    assert (result.passed, result.status, result.detail) == (False, "failed", "AssertionError")


@pytest.mark.parametrize("leave", ["import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"])
def test_leaving_before_the_tests_is_a_failure(leave):
    result = run_candidate(f"{leave}\nassert False\n")
    assert (result.passed, result.status) == (False, "failed")


def test_an_infinite_loop_times_out_on_the_wall_clock():
    result = run_candidate("while True:\n    pass\n", timeout=1.0)
    assert (result.passed, result.status) == (False, "timeout")
    assert result.seconds < 1.0 + SLACK


def test_cpu_time_is_limited_separately_from_the_wall_clock():
    result = run_candidate("while True:\n    pass\n", timeout=30.0, cpu_seconds=1)
    assert (result.passed, result.status) == (False, "timeout")
    assert "CPU" in result.detail and result.seconds < 2.0 + SLACK


def test_a_memory_hog_is_stopped_by_the_address_space_limit():
    result = run_candidate("hog = bytearray(4 * 1024**3)\n", memory_mb=512)
    assert (result.passed, result.status) == (False, "error")
    assert "MemoryError" in result.detail


@pytest.mark.parametrize("through", ["prlimit", "preexec_fn"])
def test_the_candidate_runs_under_its_limits_set_by_prlimit_or_between_fork_and_exec(through, monkeypatch):
    """prlimit sets the limits and executes the launch (the evaluator then starts it with vfork, ~2 ms where a
    fork of a process holding a model that runs Python before exec takes over 100 ms); without prlimit, the
    preexec_fn sets the same ones."""
    from refusion_cli.harness import sandbox_runner

    if through == "preexec_fn":
        monkeypatch.setattr(sandbox_runner, "_prlimit", lambda: None)
    else:
        assert sandbox_runner._prlimit() is not None, "util-linux's prlimit is missing here"
    program = ("import resource\nfor kind in ('CPU', 'AS', 'FSIZE', 'CORE'):\n"
               "    print(kind, *resource.getrlimit(getattr(resource, 'RLIMIT_' + kind)))\n")
    result = run_candidate(program, memory_mb=700, cpu_seconds=3)
    assert result.passed, result.detail
    assert result.stdout.splitlines() == ["CPU 3 4", f"AS {700 * 2**20} {700 * 2**20}",
                                          f"FSIZE {16 * 2**20} {16 * 2**20}", "CORE 0 0"]


def test_a_bounded_fork_bomb_scores_zero_and_leaves_no_process_behind():
    # Bypasses the guard (posix.fork); at most 200 children, each just sleeps, so a failed limit cannot hurt the machine.
    marker = f"3600.{secrets.randbelow(10**9)}"
    bomb = textwrap.dedent(f"""
        import posix, time
        for _ in range(200):
            try:
                pid = posix.fork()
            except OSError:  # RLIMIT_NPROC reached
                break
            if pid == 0:
                posix.execv("/bin/sleep", ["sleep", "{marker}"])
        time.sleep(3600)
    """)
    result = run_candidate(bomb, timeout=HOSTILE_TIMEOUT)
    assert (result.passed, result.status) == (False, "timeout")
    assert result.seconds < HOSTILE_TIMEOUT + SLACK
    assert leftover_processes(marker) == []


@pytest.mark.skipif(not (isolation().pid_namespace or isolation().throwaway_user),
                    reason="neither a PID namespace nor the throwaway user is available: setsid escapes the kill")
def test_a_child_that_leaves_the_process_group_is_killed_too():
    marker = f"3600.{secrets.randbelow(10**9)}"
    daemon = textwrap.dedent(f"""
        import posix
        if posix.fork() == 0:
            posix.setsid()
            posix.execv("/bin/sleep", ["sleep", "{marker}"])
    """)
    assert run_candidate(daemon).passed  # the program itself ends normally
    assert leftover_processes(marker) == []


def test_the_guard_refuses_to_fork():
    result = run_candidate("import os\nos.fork()\n")
    assert result.status == "failed" and "os.fork is disabled" in result.detail


@pytest.fixture
def precious(tmp_path):
    """A file (and its folder) outside any sandbox directory, which candidates try to delete."""
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "data.txt").write_text("keep me")
    return folder


DELETERS = {
    "os.remove": "import os\nos.remove({file!r})",
    "os.unlink": "import os\nos.unlink({file!r})",
    "shutil.rmtree": "import shutil\nshutil.rmtree({folder!r})",
    "os.system": "import os\nassert os.system('rm -rf {folder}') == 0",
    "subprocess": "import subprocess\nsubprocess.run(['rm', '-rf', {folder!r}], check=True)",
}


@pytest.mark.parametrize("attempt", DELETERS.values(), ids=DELETERS.keys())
def test_deleting_files_outside_the_sandbox_scores_zero_and_the_files_stay(precious, attempt):
    program = attempt.format(file=str(precious / "data.txt"), folder=str(precious)) + "\nassert True\n"
    result = run_candidate(program)
    assert not result.passed
    assert (precious / "data.txt").read_text() == "keep me"


@needs_jail_or_throwaway_user
@pytest.mark.parametrize("attempt", [
    "import posix\nposix.unlink({file!r})",  # the guard's os.unlink bypassed
    "import posix\nposix.system('rm -rf {folder}')",  # in the jail the folder is not even there
    "open({file!r}, 'w').write('overwritten')",
])
def test_the_jail_or_throwaway_user_protects_files_even_past_the_guard(precious, attempt):
    run_candidate(attempt.format(file=str(precious / "data.txt"), folder=str(precious)))
    assert (precious / "data.txt").read_text() == "keep me"


def test_each_candidate_gets_a_fresh_directory_that_is_deleted_afterwards():
    program = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.listdir('.'))\n"
    first, second = run_candidate(program), run_candidate(program)
    (first_dir, first_listing), (second_dir, second_listing) = first.stdout.splitlines(), second.stdout.splitlines()
    assert first.passed and sorted(eval(first_listing)) == sorted(eval(second_listing)) == ["candidate.py",
                                                                                            "scratch.txt"]
    if not isolation().jail:  # in a jail the same path each time, on a tmpfs of its own
        assert first_dir != second_dir and not os.path.exists(first_dir)


def test_the_evaluators_secrets_are_not_in_the_candidates_environment(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret456")
    result = run_candidate("import os\nprint(dict(os.environ))\nassert 'HF_TOKEN' not in os.environ\n")
    assert result.passed
    assert "secret123" not in result.stdout and "secret456" not in result.stdout
    assert "HOME" in result.stdout and "PYTHONHASHSEED': '0'" in result.stdout


@needs_jail_or_throwaway_user
def test_the_evaluators_environment_cannot_be_read_through_proc(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret123")
    result = run_candidate(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())\n")
    assert not result.passed and "secret123" not in result.stdout


@pytest.fixture
def listener():
    """A TCP server on the evaluator's loopback: reachable by anything that shares its network."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


CONNECT = "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3).close()\n"


@pytest.mark.skipif(not isolation().network_namespace, reason=network_isolation())
def test_a_network_connection_fails_in_the_network_namespace(listener):
    result = run_candidate(CONNECT.format(port=listener))
    # the namespace's own loopback: down (unshare), or up with no listener (bwrap)
    assert result.status == "failed" and ("unreachable" in result.detail or "refused" in result.detail)


def test_a_network_attempt_never_hangs_the_evaluator(listener):
    """Holds with or without isolation; without it the connection succeeds (see network_isolation())."""
    result = run_candidate(CONNECT.format(port=listener) + "import time\ntime.sleep(3600)\n", timeout=HOSTILE_TIMEOUT)
    assert not result.passed and result.seconds < HOSTILE_TIMEOUT + SLACK


def test_huge_output_is_truncated_to_its_end():
    result = run_candidate("print('x' * 1_000_000)\nprint('the end')\n")
    assert result.passed and len(result.stdout) == OUTPUT_CHARS and result.stdout.endswith("x\nthe end\n")


def test_run_many_keeps_the_order_and_survives_hostile_neighbours():
    programs = ["while True: pass", "assert 1 == 1", "hog = bytearray(4 * 1024**3)", "assert 1 == 2", "print(7)"]
    results = run_many(programs, workers=2, timeout=HOSTILE_TIMEOUT)
    assert [r.status for r in results] == ["timeout", "passed", "error", "failed", "passed"]
    assert results[-1].stdout == "7\n"


def test_the_evaluator_is_unharmed_after_all_of_the_above():
    """Runs last in this file: a normal candidate still passes."""
    assert run_candidate("import math\nassert math.isclose(math.sqrt(2) ** 2, 2)\n").passed
