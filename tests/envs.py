"""Environment for the command-line tests' subprocesses."""

import os


def cache_env() -> dict[str, str]:
    """The temporary cache folders conftest.py chose (subprocesses with a minimal environment keep them)."""
    return {"HF_HOME": os.environ["HF_HOME"], "MPLCONFIGDIR": os.environ["MPLCONFIGDIR"]}
