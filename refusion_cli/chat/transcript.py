"""Saving a conversation (``/save``, ``/save!``, ``--save``) as a JSON file.

Contract of :func:`save_transcript`: the record is written to a scratch file in the target's folder
(:func:`scratch_path`) and renamed over the target at the end (:func:`refusion_cli.paths.write_atomically`),
so a reader (or a crash) never sees half a file. An existing target is refused (:class:`FileExists`) unless ``replace``; a path that
cannot be written is a :class:`UserError` naming the path and the reason. Both leave the target as
it was. :func:`check_target` and :func:`check_writable` find those before anything is written
(``--save`` calls them before the model loads).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from refusion_cli.errors import UserError
from refusion_cli.paths import probe_new_file, write_atomically


class FileExists(UserError):
    """The target exists and replacing it was not asked for."""


def scratch_path(path: Path) -> Path:
    """Where ``path`` is written before the rename: a short hidden name in the same folder (the same file system)."""
    return path.parent / f".refusion-chat-{os.getpid()}.tmp"


def check_target(path: Path, *, replace: bool = False) -> None:
    """Refuse a target that is a folder or lies in no folder, or a file that exists when ``replace`` is off."""
    try:
        is_folder, exists, in_folder = path.is_dir(), path.exists(), path.parent.is_dir()
    except OSError as exc:  # e.g. a name too long for the file system
        raise cannot_write(path, exc) from exc
    if is_folder:
        raise UserError(f"{path} is a folder, not a file")
    if not in_folder:
        raise UserError(f"cannot write {path}: there is no folder {path.parent}")
    if exists and not replace:
        raise FileExists(f"{path} already exists")


def check_writable(path: Path) -> None:
    """Create and remove the scratch file ``path`` is written through: a folder that takes no new file
    (read-only, no permission) is a :class:`UserError` now, not after the conversation it was to keep."""
    try:
        probe_new_file(path.parent)
    except OSError as exc:
        raise cannot_write(path, exc) from exc


def save_transcript(path: Path, record: dict[str, Any], *, replace: bool = False) -> None:
    """Write ``record`` to ``path`` as indented UTF-8 JSON, atomically (see the module doc)."""
    check_target(path, replace=replace)
    text = json.dumps(record, indent=2, ensure_ascii=False) + "\n"
    try:
        write_atomically(path, text, scratch_path(path))
    except OSError as exc:
        raise cannot_write(path, exc) from exc


def cannot_write(path: Path, exc: OSError) -> UserError:
    return UserError(f"cannot write {path}: {exc.strerror or exc}")
