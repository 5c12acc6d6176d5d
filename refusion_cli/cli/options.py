"""Value parsers shared by the commands' options (typer ``parser=``): a bad value is click's one-line usage error."""

from __future__ import annotations

from pathlib import Path

import typer


def path_value(value: str | Path) -> Path:
    """A file or folder option: an empty value is refused, where ``Path("")`` would quietly mean the working
    directory (``--output ""`` writing a run's files into it, ``--data-dir ""`` reading from it)."""
    if not str(value).strip():
        raise typer.BadParameter("the path is empty (use '.' for the working directory)")
    return Path(value)


PATH_OPTION = {"parser": path_value, "metavar": "<path>"}  # typer.Option(..., **PATH_OPTION): checked, shown as <path>


def text_value(value: str) -> str:
    """A name option (``--device``, ``--model``): an empty value is refused, where it would quietly mean the default."""
    if not value.strip():
        raise typer.BadParameter("the value is empty (leave the option out for the default)")
    return value


SEED_LIMIT = 2**63  # torch generators take seeds below 2**64; bench adds the prompt's index to the seed


def seed_value(value: str | int) -> int:
    """``--seed``: a whole number from 0 to 2**63 - 1 (a larger one overflows the generators' seed)."""
    try:
        seed = int(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a whole number") from None
    if not 0 <= seed < SEED_LIMIT:
        raise typer.BadParameter(f"must be a whole number from 0 to {SEED_LIMIT - 1}, got {seed}")
    return seed
