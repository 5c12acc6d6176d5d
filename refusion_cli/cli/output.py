"""The one place that prints: a shared Rich console and the error reporter."""

from __future__ import annotations

import os
import sys
import traceback

from rich.console import Console, RenderableType
from rich.text import Text

console = Console()
err_console = Console(stderr=True)

DEBUG_ENV = "REFUSION_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in {"", "0", "false", "no"}


def fail(message: str, hint: str | None = None, code: int = 2) -> None:
    """Print one error line to stderr (the hint, if any, after the message) and exit with ``code``.

    The line is never wrapped, so ``grep error:`` finds all of it.
    """
    line = Text.assemble(("error:", "bold red"), " ", message)
    if hint:
        line.append(" (hint: ", style="dim").append(hint).append(")", style="dim")
    err_console.print(line, highlight=False, soft_wrap=True)
    sys.exit(code)


def show_traceback() -> None:
    """Inside an ``except`` block: print the caught exception's traceback when debugging."""
    if debug_enabled():
        traceback.print_exc()


def fail_handled(message: str, hint: str | None = None, code: int = 2) -> None:
    """:func:`fail` from inside an ``except`` block, after the caught exception's traceback when debugging."""
    show_traceback()
    fail(message, hint, code)


def print_table(table: RenderableType) -> None:
    """A table on stdout: at the terminal's width there, at its natural width in a file or pipe
    (where Rich would otherwise squeeze it into 80 columns and cut cells)."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(width=1000, color_system=None).print(table)


def quiet_library_output() -> None:
    """Keep the terminal to our own lines: no transformers progress bars or notices, no Accelerate save notices."""
    import logging

    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)  # "Removed shared tensor ..." on each save
