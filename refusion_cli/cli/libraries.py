"""The libraries a command imports (torch, transformers, lm-eval: millions of objects that live as long as the
process), kept out of the garbage collector's scans."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def libraries_imported() -> Iterator[None]:
    """Imports inside the block run with the garbage collector off; whatever they added is then frozen
    (``gc.freeze``), so that a full collection (each model freed, each bench row's memory window) scans what
    the command made, not the libraries. Nothing is frozen when the block imported no new module (a test, a
    second run in one process)."""
    modules, enabled = len(sys.modules), gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        if enabled:
            gc.enable()
