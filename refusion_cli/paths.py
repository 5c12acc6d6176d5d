"""Checks on paths a command will write to, made before anything is written."""

from __future__ import annotations

import tempfile
from pathlib import Path

from refusion_cli.errors import UserError


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
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise UserError(f"{option} {path} is not writable: cannot create a file in {existing} "
                        f"({exc.strerror or exc})", hint=hint) from None
