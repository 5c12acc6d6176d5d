"""The accuracy/speed frontier of a ``--sweep`` run: its points, their Pareto fronts, ``frontier.csv``.

A frontier point is a decoder's usual row or one of its sweep rows, or the same for a ReFusion
decoding variant (``causal_fix``, ``causal_first``, ``recheck``) (:func:`is_frontier_entry`; batch 1,
the KV cache reused), with an accuracy. Points are grouped by decoder (each variant a group of its
own, e.g. "refusion (recheck)") and response length; a point is on its group's front when no other point of the group is at least as
accurate and as fast and better on one of the two. Speed is TPS (batch 1, ``on_front``) or
tokens per forward (``on_front_tpf``): the two fronts may hold different points, and each plot
draws its own.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from refusion_cli.bench.runner import BenchEntry, BenchRow, variant_name
from refusion_cli.bench.sweep import setting_label

FRONTIER_CSV = "frontier.csv"


@dataclass(frozen=True)
class FrontierPoint:
    decoder: str  # refusion, ar, llada, dream, or refusion and a variant ("refusion (causal fix)")
    setting: str  # what its parallelism settings make it do (sweep.setting_label), e.g. "k=8 b=16 τ=0.9/0.9"
    label: str  # the row's label in bench.csv
    gen_length: int
    tps: float
    tpf: float
    accuracy: float  # share of correct decodes, 0..1
    on_front: bool = False  # on its decoder's accuracy/TPS Pareto front at this length
    on_front_tpf: bool = False  # on its decoder's accuracy/tokens-per-forward Pareto front at this length


FRONTIER_FIELDS = [f.name for f in fields(FrontierPoint)]


def is_frontier_entry(entry: BenchEntry) -> bool:
    """A decoder's or a decoding variant's usual row, or a sweep row (all at batch 1 with the KV cache
    reused), not the recompute ablation or a batch row. Its group is :func:`variant_name`."""
    return entry.label == variant_name(entry) or is_sweep_entry(entry)


def is_sweep_entry(entry: BenchEntry) -> bool:
    """A row --sweep adds: labelled with its decoder (and variant) and setting, e.g. "llada steps=64"."""
    return entry.label == f"{variant_name(entry)} {setting_label(entry.decoder, entry.config)}"


def on_pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (speed, accuracy) point: whether no other point is at least as good on both and better on one."""
    return [not any(speed >= mine and accuracy >= my_accuracy and (speed > mine or accuracy > my_accuracy)
                    for speed, accuracy in points)
            for mine, my_accuracy in points]


def frontier_points(entries: Sequence[BenchEntry], rows: Sequence[BenchRow]) -> list[FrontierPoint]:
    """The frontier points of ``rows`` (the first ``len(rows)`` of the planned ``entries``), in row order."""
    points = [FrontierPoint(variant_name(entry), setting_label(entry.decoder, entry.config), row.decoder, row.gen_length,
                            row.tps, row.tpf, row.accuracy)
              for entry, row in zip(entries, rows) if is_frontier_entry(entry) and row.accuracy is not None]
    flagged: dict[int, FrontierPoint] = {}
    for group in dict.fromkeys((point.decoder, point.gen_length) for point in points):
        indices = [i for i, point in enumerate(points) if (point.decoder, point.gen_length) == group]
        by_tps = on_pareto_front([(points[i].tps, points[i].accuracy) for i in indices])
        by_tpf = on_pareto_front([(points[i].tpf, points[i].accuracy) for i in indices])
        for i, tps_front, tpf_front in zip(indices, by_tps, by_tpf):
            flagged[i] = FrontierPoint(**{**asdict(points[i]), "on_front": tps_front, "on_front_tpf": tpf_front})
    return [flagged[i] for i in range(len(points))]


def write_frontier_csv(path: Path, points: Sequence[FrontierPoint]) -> None:
    """One record per point; floats to 6 decimals, the flags as true / false."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=FRONTIER_FIELDS)
        writer.writeheader()
        for point in points:
            writer.writerow({key: (round(value, 6) if isinstance(value, float) else
                                   str(value).lower() if isinstance(value, bool) else value)
                             for key, value in asdict(point).items()})
