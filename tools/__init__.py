"""Maintainer scripts: rebuild the embedded models, regenerate the synthetic task, measure the decoders.

Run them from the repository root, e.g. ``python -m tools.build_models`` (what ``make models`` runs),
``python -m tools.synthetic``, ``python -m tools.tokenizer``, ``python -m tools.probe``,
``python -m tools.overhead``, ``python -m tools.batch_headroom``, ``python -m tools.data_provenance``,
``python -m tools.reference_solutions``. They import the library; the
library never imports them (an import-linter contract in pyproject.toml), and they are not part of
the installed package.
"""

from __future__ import annotations

import argparse
import os


def set_threads(parser: argparse.ArgumentParser, threads: int) -> None:
    """Use ``threads`` torch CPU threads, or stop with a usage error naming ``--threads`` when the machine
    has not that many (torch refuses 0 or less and crashes far above the CPU count)."""
    import torch

    cpus = os.cpu_count() or 1
    if not 1 <= threads <= cpus:
        parser.error(f"--threads must be from 1 to this machine's {cpus} CPU threads, got {threads}")
    torch.set_num_threads(threads)
