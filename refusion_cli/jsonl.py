"""JSON lines read from a user's file: one object per line, a bad line named by file and number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from refusion_cli.errors import UserError


def json_objects(text: str, label: str, hint: str = "it needs one JSON object per line") -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of ``text``; ``label`` names the file in errors.

    A line that is not valid JSON, or is JSON but not an object, is a UserError naming the line.
    """
    for number, line in enumerate(json_lines(text), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{label}, line {number}, is not valid JSON: {exc.msg} (column {exc.colno})",
                            hint=hint) from None
        if not isinstance(value, dict):
            raise UserError(f"{label}, line {number}, is not a JSON object", hint=hint)
        yield number, value


def json_lines(text: str) -> list[str]:
    """``text`` cut at its newlines (``\\n`` or ``\\r\\n``) and nowhere else.

    Not ``str.splitlines()``: that also cuts at U+2028, U+2029, U+0085 and other characters that JSON
    allows unescaped inside a string (the GPQA data holds U+2028), which would tear a record in two.
    """
    return [line.removesuffix("\r") for line in text.split("\n")]


def read_text(path: Path, label: str) -> str:
    """A JSON-lines file's text (a UTF-8 byte-order mark is dropped); unreadable or non-UTF-8 is a UserError."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{label} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {label}: {exc.strerror or exc}") from None
