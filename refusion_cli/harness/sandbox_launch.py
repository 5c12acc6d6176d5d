"""How a candidate's process starts: in a bubblewrap jail, or (without one) through ``unshare``, as which user.

Contract: a :class:`Launch` turns the runner's arguments into one command line (and, outside a jail, the user
``subprocess`` switches to); it knows nothing of limits or results (``sandbox_runner``) or of which launch this
machine allows (``sandbox``, which probes them). Linux only.

The jail (``bwrap``, the bubblewrap of Flatpak; :func:`jail_mounts`) gives a candidate a file system made of:

- read-only binds of ``/usr`` (with ``/bin``, ``/lib*``, ``/sbin`` as on the host), a few files of ``/etc``
  (the dynamic linker's cache, the time zone), the evaluator's Python (its prefixes: binary and standard
  library) and package folders (:func:`package_paths`); of a source checkout a ``.pth`` file adds (an old
  editable install) only what is importable: its packages and modules, not its data or results;
- a private ``/tmp`` (the working directory ``/tmp/candidate`` inside it) and ``/dev/shm``, each a tmpfs of
  ``JAIL_TMP_BYTES`` (where bwrap has ``--size``: :func:`tmpfs_limit`), gone with the jail; a fresh ``/proc``
  and a minimal ``/dev``;
- nothing else: not root's home, other users' files, the evaluator's results or the machine's ``/tmp``.

It runs in new IPC, network (only a loopback of its own), PID, UTS and cgroup namespaces, in a new session,
with no capabilities, and dies with the evaluator (``--die-with-parent``). As root the candidate runs as a
throwaway uid (``setpriv`` drops to it inside the jail, so RLIMIT_NPROC counts its processes); otherwise, or
without ``setpriv``, as uid 65534 of a user namespace. ``REFUSION_BWRAP`` names another ``bwrap`` (a missing
file: no jail).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

BWRAP_ENV = "REFUSION_BWRAP"  # the bwrap to use instead of the one on PATH (a missing file: no jail)
JAIL_TMP_BYTES = 64 * 2**20  # the size of the jail's /tmp (working directory included) and of its /dev/shm
JAIL_WORKDIR = "/tmp/candidate"  # the candidate's working directory (and HOME) inside the jail
JAIL_UID = 65534  # the candidate's uid inside a jail's user namespace ("nobody")

# Throwaway uids/gids are drawn from this range, far above any real account.
SANDBOX_ID_BASE = 3_000_000_000
SANDBOX_ID_SPAN = 1_000_000

# Namespace flags for `unshare`; --kill-child makes unshare kill the candidate when it is killed.
UNSHARE_NAMESPACES = ("--net", "--pid", "--fork", "--kill-child")
_USER_NAMESPACE = ("--user", "--map-current-user")  # lets an unprivileged user create the others

_JAIL_NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try")
_SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pth", ".zip", ".egg")
_PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg", ".git")  # a folder with one is a source checkout


class PopenUser(TypedDict, total=False):
    """subprocess.Popen's keywords that switch the child to another user."""

    user: int
    group: int
    extra_groups: list[int]


@dataclass(frozen=True)
class Launch:
    """One way of starting the candidate: in a jail or through which namespaces, as which user, with which Python."""

    namespaces: tuple[str, ...]  # unshare flags (outside a jail); empty = no unshare
    throwaway_user: bool  # root only: run as a random unused uid/gid
    interpreter: str
    bwrap: str = ""  # the bubblewrap binary: the candidate runs in a jail

    @property
    def jail(self) -> bool:
        return bool(self.bwrap)

    def argv(self, sandbox_id: int | None, runner_args: Sequence[str], candidate_file: str) -> list[str]:
        """The command line; `candidate_file`: the program on the host (the jail binds it into its workdir)."""
        command = [self.interpreter, "-S", "-s", *runner_args]
        if self.jail:
            return self._jail_argv(sandbox_id, command, candidate_file)
        if not self.namespaces:
            return command
        switch_user = [] if sandbox_id is None else ["--setgid", str(sandbox_id), "--setuid", str(sandbox_id)]
        return ["unshare", *self.namespaces, *switch_user, "--", *command]

    def popen_user(self, sandbox_id: int | None) -> PopenUser:
        """Without unshare or a jail, subprocess itself switches to the throwaway user."""
        if sandbox_id is None or self.namespaces or self.jail:
            return PopenUser()
        return {"user": sandbox_id, "group": sandbox_id, "extra_groups": []}

    def workdir(self, host_workdir: str) -> str:
        """The candidate's working directory as it sees it."""
        return JAIL_WORKDIR if self.jail else host_workdir

    def _jail_argv(self, sandbox_id: int | None, command: list[str], candidate_file: str) -> list[str]:
        if sandbox_id is None:  # uid 65534 of a user namespace (the evaluator's uid outside)
            user = ["--unshare-user", "--uid", str(JAIL_UID), "--gid", str(JAIL_UID), "--cap-drop", "ALL"]
            switch_user: list[str] = []
        else:  # root: keep only what setpriv needs to become the throwaway uid; it drops every capability
            user = ["--cap-drop", "ALL", *(arg for cap in ("SETUID", "SETGID", "SETPCAP") for arg in ("--cap-add",
                                                                                                        f"CAP_{cap}"))]
            switch_user = ["setpriv", "--reuid", str(sandbox_id), "--regid", str(sandbox_id), "--clear-groups",
                           "--inh-caps=-all", "--bounding-set=-all", "--"]
        size = ["--size", str(JAIL_TMP_BYTES)] if tmpfs_limit(self.bwrap) else []
        scratch = [  # first: a Python or venv under /tmp is bound inside the private /tmp
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", *size, "--tmpfs", "/tmp", "--perms", "1777", *size, "--tmpfs", "/dev/shm",
            "--perms", "0777", "--dir", JAIL_WORKDIR,
            "--ro-bind", candidate_file, os.path.join(JAIL_WORKDIR, os.path.basename(candidate_file)),
        ]
        return [self.bwrap, *_JAIL_NAMESPACES, *user, "--die-with-parent", "--new-session", *scratch,
                *jail_mounts(), "--remount-ro", "/", "--chdir", JAIL_WORKDIR, "--", *switch_user, *command]


def launch_candidates(jail_only: bool = False) -> list[Launch]:
    """Every launch to try here, strongest first: the jail (where bwrap is), then unshare and plain launches."""
    found = [Launch((), user, sys.executable, bwrap) for bwrap in [bwrap_path()] if bwrap
             for user in ([True, False] if os.geteuid() == 0 and shutil.which("setpriv") else [False])]
    return found if jail_only else found + unjailed_candidates()


def unjailed_candidates() -> list[Launch]:
    """Without a jail: namespaces through unshare where it can make them, the throwaway user as root."""
    interpreters = _interpreters()
    if os.geteuid() == 0:
        # As root unshare needs no user namespace; --setuid/--setgid then drop to the throwaway user.
        configurations = [(UNSHARE_NAMESPACES, True), ((), True), (UNSHARE_NAMESPACES, False), ((), False)]
    else:
        configurations = [(_USER_NAMESPACE + UNSHARE_NAMESPACES, False), ((), False)]
    if shutil.which("unshare") is None:
        configurations = [(flags, user) for flags, user in configurations if not flags]
    return [Launch(flags, user, python) for flags, user in configurations for python in interpreters]


def bwrap_path() -> str:
    """The bwrap binary: REFUSION_BWRAP, else the one on PATH; "" when there is none."""
    chosen = os.environ.get(BWRAP_ENV) or shutil.which("bwrap") or ""
    return chosen if chosen and os.access(chosen, os.X_OK) else ""


@functools.cache
def tmpfs_limit(bwrap: str) -> int:
    """The size of the jail's /tmp and /dev/shm: JAIL_TMP_BYTES, or 0 where this bwrap has no --size (before 0.8:
    then each is bounded by the kernel's default, half the memory, and by the time limit)."""
    import subprocess

    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return JAIL_TMP_BYTES if "--size" in usage else 0


def no_bwrap() -> str:
    """Why there is no bwrap to use, in a few words."""
    chosen = os.environ.get(BWRAP_ENV)
    return f"{BWRAP_ENV}={chosen} is not an executable" if chosen else "no bwrap on PATH (package bubblewrap)"


def describe_launch(launch: Launch) -> str:
    if launch.jail:
        return f"jail ({launch.bwrap}, {'throwaway user' if launch.throwaway_user else f'uid {JAIL_UID}'})"
    parts = ["unshare " + " ".join(launch.namespaces) if launch.namespaces else "no namespaces"]
    parts.append("throwaway user" if launch.throwaway_user else "same user")
    return f"{', '.join(parts)}, {launch.interpreter}"


def _interpreters() -> list[str]:
    """The evaluator's Python first; the others only serve when the sandbox user cannot execute it."""
    found = [sys.executable, getattr(sys, "_base_executable", ""), os.path.realpath(sys.executable)]
    found.append(shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "")
    return list(dict.fromkeys(path for path in found if path))


def is_evaluators(interpreter: str) -> bool:
    """True when `interpreter` is the binary the evaluator runs (through a venv's link or not)."""
    own = {os.path.realpath(path) for path in (sys.executable, getattr(sys, "_base_executable", "")) if path}
    return os.path.realpath(interpreter) in own


# --- what the jail binds -------------------------------------------------------------------------


@functools.cache
def jail_mounts() -> tuple[str, ...]:
    """bwrap arguments for the jail's read-only file system: the system folders, a few /etc files, the evaluator's
    Python and its package paths, each at its own path (the folders leading to it created empty, mode 755)."""
    arguments: list[str] = []
    for folder in _SYSTEM_FOLDERS:
        if os.path.islink(folder):  # merged /usr: /lib -> usr/lib
            arguments += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            arguments += ["--ro-bind", folder, folder]
    for path in _ETC_FILES:
        arguments += ["--ro-bind-try", path, path]
    made = {"/", *_SYSTEM_FOLDERS, "/etc", "/tmp"}
    for path in _python_binds():
        for parent in _parents(path):
            if parent not in made:
                arguments += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        arguments += ["--ro-bind", path, path]
        made.add(path)
    return tuple(arguments)


def _python_binds() -> list[str]:
    """The evaluator's Python (prefixes, the interpreter's folder) and package paths at their real paths, none
    inside another or inside /usr; of a source checkout a .pth file adds, only its importable entries."""
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    wanted = [*prefixes, *package_folders()]
    for path in package_paths():
        wanted += _importable_entries(path) if _source_checkout(path) else [path]
    found = set()
    for path in (os.path.abspath(path) for path in wanted if os.path.exists(path)):
        found.add(os.path.realpath(path))  # /lib/python3/... is /usr/lib/python3/..., under /usr
        if os.path.realpath(os.path.dirname(path)) == os.path.dirname(path):  # a link itself, in a real folder
            found.add(path)
    kept = sorted(found)
    return [path for path in kept if not any(_inside(path, other) for other in [*kept, "/usr"] if other != path)]


def _source_checkout(folder: str) -> bool:
    """A project's own folder (an old-style editable install adds it): its results and data are no package."""
    return os.path.isdir(folder) and any(os.path.exists(os.path.join(folder, name)) for name in _PROJECT_FILES)


def _importable_entries(folder: str) -> list[str]:
    """What `import` can reach in `folder`: packages (folders with ``__init__.py``), modules and their metadata."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    entries = []
    for name in names:
        path = os.path.join(folder, name)
        package = os.path.isdir(path) and (os.path.exists(os.path.join(path, "__init__.py"))
                                           or name.endswith((".dist-info", ".egg-info")))
        if package or (os.path.isfile(path) and name.endswith(_MODULE_SUFFIXES)):
            entries.append(path)
    return entries


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def _parents(path: str) -> list[str]:
    """"/a/b/c" -> ["/a", "/a/b"]."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: index + 1]) for index in range(len(parts))]


# --- the evaluator's packages ------------------------------------------------------------------


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
