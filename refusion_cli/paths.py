"""Checks on paths a command will write to, made before anything is written, where a run writes when no
``--output`` is given (:func:`fresh_run_dir`), the one way a whole file is replaced (:func:`write_atomically`),
and what identifies a folder's files (:func:`folder_fingerprint`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import tempfile
from pathlib import Path

from refusion_cli.errors import UserError


RUNS_DIR = Path("runs")  # under the working directory; ignored by git in the checkout (.gitignore)


def fresh_run_dir(command: str, now: dt.datetime | None = None) -> Path:
    """A folder no run has written yet, for a run without ``--output``: ``runs/<command>-YYYYMMDD-HHMMSS``
    (``-2``, ``-3``, ... after it when a run of the same second has it), never a committed results folder."""
    stem = f"{command}-{(now or dt.datetime.now()).strftime('%Y%m%d-%H%M%S')}"
    candidates = (RUNS_DIR / (stem if n == 1 else f"{stem}-{n}") for n in itertools.count(1))
    return next(path for path in candidates if not path.exists())


def check_output_dir(path: Path, hint: str, option: str = "--output") -> None:
    """Refuse an ``--output`` (or another ``option``) that files cannot be written to, leaving the file system
    as it was.

    ``path`` must be a directory or not exist yet, and the nearest of it and its parents that
    exists must be a directory that takes new files (probed with a temporary file, gone at once).
    """
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise UserError(f"{option} {path} {where}, not a directory", hint=hint)
    try:
        probe_new_file(existing)
    except OSError as exc:
        raise UserError(f"{option} {path} is not writable: cannot create a file in {existing} "
                        f"({exc.strerror or exc})", hint=hint) from None


def probe_new_file(folder: Path) -> None:
    """Create a temporary file in ``folder`` and remove it at once; OSError when the folder takes no new file."""
    with tempfile.TemporaryFile(dir=folder):
        pass


def write_atomically(path: Path, text: str, scratch: Path | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` through ``scratch`` (default ``<path>.tmp``, the same folder) renamed
    over ``path`` at the end, so a reader or a crash never sees half a file. If writing fails the scratch
    file is removed and the OSError raised."""
    scratch = scratch or path.with_name(path.name + ".tmp")
    try:
        scratch.write_text(text, encoding="utf-8")
        scratch.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # never written, or not ours to remove
            scratch.unlink()
        raise


def folder_fingerprint(folder: Path, config_file: str, weight_files: list[Path]) -> str:
    """What identifies the files of a checkpoint or adapter ``folder``: its resolved path, the bytes of its
    ``config_file`` (when present) and each of ``weight_files`` that exists (name, size, mtime), in order."""
    parts = [str(folder.resolve())]
    if (folder / config_file).is_file():
        parts.append(hashlib.sha256((folder / config_file).read_bytes()).hexdigest())
    for weights in weight_files:
        if weights.is_file():
            stat = weights.stat()
            parts.append(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)
