"""Leaving a data-parallel run cleanly (shared by `refusion train` and `refusion eval`)."""

from __future__ import annotations


def leave_process_group() -> None:
    """Wait for every process, then destroy the process group (when there is one).

    A process that exits with its group still up can tear a gloo connection while a slower peer
    still uses it, and that peer aborts (SIGABRT) although its work was done.
    """
    import torch  # the command line imports this module; torch loads only when a command runs

    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
