"""Environment for the command-line tests' subprocesses, and the folder the xdist workers share."""

import os
from pathlib import Path


def cache_env() -> dict[str, str]:
    """The temporary cache folders conftest.py chose (subprocesses with a minimal environment keep them)."""
    return {"HF_HOME": os.environ["HF_HOME"], "MPLCONFIGDIR": os.environ["MPLCONFIGDIR"]}


def shared_folder(tmp_path_factory) -> Path:
    """A folder of this run that every xdist worker sees (the workers' temporary folders share their parent)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent
    return tmp_path_factory.getbasetemp()
