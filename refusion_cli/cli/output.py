"""The one place that prints: a shared Rich console and the error reporter."""

from __future__ import annotations

import os
import sys

from rich.console import Console

console = Console()
err_console = Console(stderr=True)

DEBUG_ENV = "REFUSION_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in {"", "0", "false", "no"}


def fail(message: str, hint: str | None = None, code: int = 2) -> None:
    """Print one error line (and an optional hint) to stderr and exit with ``code``."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    if hint:
        err_console.print(f"[dim]hint:[/] {hint}", highlight=False)
    sys.exit(code)


def quiet_library_output() -> None:
    """Keep the terminal to our own lines: no transformers progress bars or notices, no Accelerate save notices."""
    import logging

    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)  # "Removed shared tensor ..." on each save
