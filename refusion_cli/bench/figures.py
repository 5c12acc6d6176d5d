"""The summary figures of a benchmark row: a mean, a percentile, a config in one line, and what its model calls
computed and copied (:class:`CallTally`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

from refusion_cli.decoding.engine import Engine


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


@dataclass
class CallTally:
    """The positions the causal calls of a row's timed decodes computed and the K/V bytes they copied (the
    ``cache.Lanes`` counts of each engine); None once a decode ran calls that do not count them."""

    positions: int | None = 0
    kv_copied: int | None = 0

    def add(self, engine: Engine) -> None:
        for calls in engine.calls.values():
            counts = getattr(calls, "counts", None)
            if counts is None or self.positions is None or self.kv_copied is None:
                self.positions = self.kv_copied = None
            else:
                self.positions += counts.positions
                self.kv_copied += counts.kv_bytes_copied

    def per_token(self, tokens: int) -> tuple[float | None, float | None]:
        if not tokens or self.positions is None or self.kv_copied is None:
            return None, None
        return self.positions / tokens, self.kv_copied / tokens
