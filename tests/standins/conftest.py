"""Stand-ins of the public checkpoints and of D2F's adapters (``tools.standins``), built once per session into
temporary folders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tools.standins import ADAPTERS, build_standin


@pytest.fixture(scope="session")
def standin(tmp_path_factory) -> Callable[[str], Path]:
    """``standin(name)``: the directory of that stand-in (built on first use, seed 0, as the golden files were);
    an adapter's names its base stand-in's directory."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            base = get(ADAPTERS[name].base) if name in ADAPTERS else None
            built[name] = build_standin(name, tmp_path_factory.mktemp(name), base=base)
        return built[name]

    return get
