"""The summary figures of a benchmark row: a mean, a percentile, a config in one line."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def describe_config(config: Any) -> str:
    return " ".join(f"{key}={value}" for key, value in dataclasses.asdict(config).items())


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
