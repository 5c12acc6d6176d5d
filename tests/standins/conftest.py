"""Stand-ins of the public checkpoints and of D2F's adapters (``tools.standins``), built once per test run into
a temporary folder; under xdist the workers share it, so that each stand-in is built by one of them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.envs import shared_folder
from tools.standins import ADAPTERS, build_standin


@pytest.fixture(scope="session")
def standin(tmp_path_factory) -> Callable[[str], Path]:
    """``standin(name)``: the directory of that stand-in (built on first use, seed 0, as the golden files were);
    an adapter's names its base stand-in's directory."""
    root = shared_folder(tmp_path_factory) / "standins"
    root.mkdir(exist_ok=True)

    def get(name: str) -> Path:
        directory, built = root / f"{name}0", root / f"{name}.built"
        with FileLock(root / f"{name}.lock"):  # another worker may be building it
            if not built.exists():
                base = get(ADAPTERS[name].base) if name in ADAPTERS else None
                build_standin(name, directory, base=base)
                built.touch()
        return directory

    return get
