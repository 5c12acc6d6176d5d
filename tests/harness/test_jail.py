"""Model-written code never has the machine in reach: hostile candidates in the bubblewrap jail, with the
toolkit's venv in a mode-700 folder (as under /root), run as root where the tests run as root; and where bwrap
is missing, a run that refuses without --allow-unjailed and says which isolation it has with it.

Each hostile candidate bypasses the guard (``posix``), as a determined one would: what holds is the jail.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from refusion_cli.harness import sandbox
from refusion_cli.harness.sandbox_launch import BWRAP_ENV, JAIL_TMP_BYTES, _python_binds
from tests.harness.helpers import run_cli
from tests.harness.test_sandbox_packages import private_venv

ROOT = Path(__file__).resolve().parents[2]
TOKEN = f"refusion-jail-test-{secrets.token_hex(6)}"  # in the name of everything a candidate tries to leave behind

needs_jail = pytest.mark.skipif(not sandbox.isolation().jail,
                                reason=f"no jail here: {sandbox.isolation().jail_refused}")

# Run by the private venv's Python from the repository root: every program through every jail launch this
# machine has (as root: the throwaway uid, and uid 65534 of a user namespace), then numpy through run_candidate.
EVALUATOR = textwrap.dedent("""
    import json, sys
    from refusion_cli.harness import sandbox
    from refusion_cli.harness.sandbox_launch import describe_launch, launch_candidates
    from refusion_cli.harness.sandbox_runner import Limits, execute

    programs = json.loads(sys.argv[1])
    found = sandbox.isolation()
    limits = Limits(timeout=3.0, memory_bytes=1024 * 2**20, cpu_seconds=3, max_processes=16)
    launches = launch_candidates(jail_only=True) if found.jail else []
    folders = sandbox.package_folders()
    ran = {describe_launch(launch): {name: list(vars(execute(program, launch, limits, folders)).values())
                                     for name, program in programs.items()} for launch in launches}
    numpy = sandbox.run_candidate("import numpy as np\\nassert int(np.arange(4).sum()) == 6\\n", timeout=20)
    print(json.dumps({"record": found.record(), "line": found.describe(), "ran": ran, "numpy": numpy.passed}))
""")

HOSTILE = {
    "writes the evaluator's home": """
        import posix
        for folder in ({home!r}, {private!r}):
            fd = posix.open(folder + "/{token}", posix.O_WRONLY | posix.O_CREAT, 0o644)
            posix.write(fd, b"x")
    """,
    "writes the results folder": """
        import posix
        fd = posix.open({results!r} + "/metrics.json", posix.O_WRONLY | posix.O_TRUNC)
        posix.write(fd, b"{{}}")
    """,
    "floods /tmp": """
        for index in range(400):
            open(f"/tmp/{token}-{{index}}", "w").write("x")
    """,
    "reads root's files": """
        print(open({secret!r}).read())
    """,
    "forks a daemon": """
        import posix
        if posix.fork() == 0:
            posix.setsid()
            posix.execv("/bin/sleep", ["sleep", "{marker}"])
    """,
    "opens a socket": """
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    """,
    "kills its parent": """
        import posix, time
        posix.kill(posix.getppid(), 9)
        try:
            posix.kill(-1, 9)  # every process it may signal
        except OSError:
            pass
        time.sleep(0.2)
    """,
    "fills its disk quota": """
        import os
        written = 0
        try:
            for index in range(1000):
                with open(f"{token}-{{index}}", "wb") as chunk:
                    chunk.write(b"x" * 2**23)
                written += 2**23
        finally:
            print(written)
    """,
}


def leftover_processes(marker: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if cmdline.read().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                    found.append(int(entry))
        except OSError:
            pass
    return found


def left_behind(*folders: Path) -> list[str]:
    """Every file or folder whose name holds TOKEN, in `folders` (top level)."""
    return [str(path) for folder in folders if folder.is_dir() for path in folder.iterdir() if TOKEN in path.name]


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory):
    """The toolkit's venv in a mode-700 home, a secret there, and a results folder with a metrics.json."""
    base = tmp_path_factory.mktemp("jail")
    venv = private_venv(base / "home")
    (base / "home" / "secret.txt").write_text("root's secret")
    (base / "home" / "secret.txt").chmod(0o600)
    (base / "results").mkdir()
    (base / "results" / "metrics.json").write_text('{"cells": []}')
    return base, venv


def environment(**changes: str) -> dict[str, str]:
    """This process's environment, without the consent to run unjailed unless `changes` give it."""
    kept = {key: value for key, value in os.environ.items() if key != sandbox.ALLOW_UNJAILED_ENV}
    return {**kept, "PYTHONPATH": str(ROOT), **changes}


def evaluate(venv: Path, programs: dict[str, str], **env: str) -> dict:
    ran = subprocess.run([str(venv / "bin" / "python"), "-c", EVALUATOR, json.dumps(programs)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, env=environment(**env))
    assert ran.returncode == 0, ran.stderr  # the evaluator went on to the end, whatever the candidates did
    return json.loads(ran.stdout)


@needs_jail
def test_hostile_candidates_fail_or_stay_in_the_jail_and_leave_nothing(toolkit):
    base, venv = toolkit
    marker = f"3600.{secrets.randbelow(10**9)}"
    server = socket.create_server(("127.0.0.1", 0))
    targets = {"home": os.path.expanduser("~"), "private": str(base / "home"), "results": str(base / "results"),
               "secret": str(base / "home" / "secret.txt"), "token": TOKEN, "marker": marker,
               "port": server.getsockname()[1]}
    programs = {name: textwrap.dedent(program).format(**targets) for name, program in HOSTILE.items()}
    try:
        seen = evaluate(venv, programs)
    finally:
        server.close()
        left = left_behind(Path(targets["home"]), base / "home", base / "results", Path("/tmp"), Path("/dev/shm"))
        daemons = leftover_processes(marker)
        for path in left:
            subprocess.run(["rm", "-rf", "--", path], check=False)
    assert left == [] and daemons == []  # nothing stays on the machine
    assert (base / "results" / "metrics.json").read_text() == '{"cells": []}'
    assert seen["record"]["jail"] and seen["line"].startswith("jail (bubblewrap)") and seen["numpy"]
    assert len(seen["ran"]) == (2 if os.geteuid() == 0 else 1)  # as root: the throwaway uid and uid 65534
    for launch, results in seen["ran"].items():
        outcome = {name: (passed, status) for name, (passed, status, _, _, stdout, _) in results.items()}
        for name in ("writes the evaluator's home", "writes the results folder", "reads root's files",
                     "opens a socket"):
            assert outcome[name] == (False, "failed"), (launch, name, results[name])
        assert "root's secret" not in results["reads root's files"][4]
        assert outcome["floods /tmp"] == (True, "passed")  # in the jail's own /tmp, gone with it
        assert outcome["forks a daemon"] == (True, "passed")  # and the daemon died with the jail
        written = int(results["fills its disk quota"][4])
        assert outcome["fills its disk quota"] == (False, "failed") and written <= JAIL_TMP_BYTES
        assert "No space left on device" in results["fills its disk quota"][2]


@needs_jail
def test_a_candidate_sees_no_file_of_the_machine_but_the_system_and_python():
    program = ("import json, os\nprint(json.dumps([sorted(os.listdir('/')), os.listdir('/tmp'), os.getcwd(), "
               "os.getuid()]))\n")
    result = sandbox.run_candidate(program)
    top, tmp, cwd, uid = json.loads(result.stdout)
    assert result.passed and "home" not in top and "var" not in top and "etc" in top
    # /tmp is the jail's own: its working folder, and the folders leading to the evaluator's Python where that
    # lies under /tmp (a checkout in a mktemp -d folder, its venv bound read-only), nothing of the machine's /tmp
    python_under_tmp = {Path(path).parts[2] for path in _python_binds() if path.startswith("/tmp/")}
    assert sorted(tmp) == sorted({"candidate"} | python_under_tmp)
    assert cwd == "/tmp/candidate" and uid != os.geteuid()


def test_without_bwrap_a_run_refuses_unless_allowed_and_says_which_isolation(toolkit):
    _, venv = toolkit
    refused = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from refusion_cli.harness.sandbox import run_candidate\n"
                                              "run_candidate('pass')\n"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=environment(**{BWRAP_ENV: "/nonexistent/bwrap"}))
    assert refused.returncode != 0
    assert ("UserError: no jail for model-written code can be made here (REFUSION_BWRAP=/nonexistent/bwrap is not "
            "an executable); without one, candidates would run with ") in refused.stderr
    seen = evaluate(venv, {}, **{BWRAP_ENV: "/nonexistent/bwrap", sandbox.ALLOW_UNJAILED_ENV: "1"})
    assert seen["numpy"] and seen["ran"] == {}
    assert seen["record"]["jail"] is False and "REFUSION_BWRAP" in seen["record"]["jail_refused"]
    assert seen["line"].startswith("NO JAIL (REFUSION_BWRAP=/nonexistent/bwrap is not an executable), weaker "
                                   "isolation: ")


@pytest.fixture
def no_bwrap(monkeypatch):
    """This process's sandbox, probed again as if bwrap were missing."""
    monkeypatch.setenv(BWRAP_ENV, "/nonexistent/bwrap")
    monkeypatch.setenv(sandbox.ALLOW_UNJAILED_ENV, "")  # and gone again after the test, whatever --allow-unjailed set
    monkeypatch.setattr(sandbox, "isolation", functools.cache(sandbox.isolation.__wrapped__))


def test_the_eval_command_without_a_jail_is_one_error_line_and_exit_2(no_bwrap, causal_checkpoint, capsys,
                                                                     monkeypatch, tmp_path):
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "humaneval", "--decoder", "ar", "--model",
                                   str(causal_checkpoint), "--limit", "1", "--confirm-run-unsafe-code",
                                   "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and stderr.count("error:") == 1 and "Traceback" not in stderr
    assert "no jail for model-written code can be made here" in stderr and "--allow-unjailed" in stderr
    assert not (tmp_path / "run").exists()


def test_the_eval_command_with_allow_unjailed_says_so_and_records_it(no_bwrap, causal_checkpoint, capsys,
                                                                    monkeypatch, tmp_path):
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "humaneval", "--decoder", "ar", "--model",
                                   str(causal_checkpoint), "--limit", "1", "--set", "gen_length=8",
                                   "--confirm-run-unsafe-code", "--allow-unjailed", "--output", str(tmp_path / "run"))
    assert code in (0, None), stderr
    assert "code sandbox: NO JAIL (REFUSION_BWRAP=/nonexistent/bwrap is not an executable)" in " ".join(stdout.split())
    cells = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert "'jail': False" in str(cells) and "is not an executable" in str(cells)
