"""The benchmark's plots (matplotlib's object API, no pyplot state; PNG files).

- :func:`plot_frontier`: accuracy against TPS, one point per decoder and length, the
  accuracy/speed Pareto frontier drawn through the points no other point beats on both axes.
- :func:`plot_sweep_frontier` (``--sweep``): accuracy against TPS or tokens per forward, one
  colour per decoder, one panel per response length, each decoder's own Pareto front drawn as a
  line through its points on the front (:mod:`refusion_cli.bench.frontier`), labelled with their settings.
- :func:`plot_length_sweep`: TPS and median latency against the response length, one line per
  decoder: how the cost of each decoder grows with the length it is asked for (two lengths or more).

matplotlib is imported when a plot is drawn; :func:`plotting_available` says whether it can be.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any
from pathlib import Path

from refusion_cli.bench.frontier import FrontierPoint
from refusion_cli.bench.runner import BenchRow

FRONTIER_FILE = "frontier.png"
FRONTIER_TPS_FILE = "frontier_tps.png"  # --sweep: accuracy against TPS, a front per decoder
FRONTIER_TPF_FILE = "frontier_tpf.png"  # --sweep: accuracy against tokens per forward, a front per decoder
SPEED_AXES = {"tps": "tokens per second (batch 1)", "tpf": "tokens per forward"}
LENGTH_FILE = "tps_vs_gen_length.png"
MARKERS = "os^Dv<>ph*"


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (tps, accuracy) points that no other point beats on both, by increasing TPS."""
    frontier: list[tuple[float, float]] = []
    best = float("-inf")
    for tps, accuracy in sorted(points, key=lambda point: (-point[0], -point[1])):
        if accuracy > best:
            frontier.append((tps, accuracy))
            best = accuracy
    return frontier[::-1]


def _figure(width: float, height: float, columns: int = 1):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def _labels(rows: Sequence[BenchRow]) -> list[str]:
    return list(dict.fromkeys(row.decoder for row in rows))


def _log_scale_if_wide(axes, values: Sequence[float], axis: str = "y") -> None:
    """A log scale when the positive values span more than 10×, so the small ones stay apart."""
    positive = [value for value in values if value > 0]
    if positive and max(positive) / min(positive) > 10:
        (axes.set_xscale if axis == "x" else axes.set_yscale)("log")


def plot_frontier(rows: Sequence[BenchRow], path: Path) -> bool:
    """Accuracy (%) against TPS; False (and no file) when no row has an accuracy."""
    return _save(frontier_figure(rows), path)


def _save(figure, path: Path) -> bool:
    """Write ``figure`` (a PNG at 120 dpi); False when there is none."""
    if figure is None:
        return False
    figure.savefig(path, dpi=120)
    return True


def frontier_figure(rows: Sequence[BenchRow]):
    """The frontier plot's figure, or None when no row has an accuracy. The legend sits right of
    the axes and the accuracy axis has a margin beyond 0 and 100 %, so no point is hidden."""
    scored = [row for row in rows if row.accuracy is not None and row.batch_size == 1]  # TPS at batch 1 only
    if not scored:
        return None
    figure, (axes,) = _figure(8, 4.5)
    lengths = sorted({row.gen_length for row in scored})
    for color, label in enumerate(_labels(scored)):
        mine = [row for row in scored if row.decoder == label]
        for row in mine:
            marker = MARKERS[lengths.index(row.gen_length) % len(MARKERS)]
            axes.scatter(row.tps, _accuracy(row) * 100, color=f"C{color}", marker=marker, s=60, zorder=3,
                         label=label if row is mine[0] else None)
    if len(lengths) > 1:  # one marker per length, explained in the legend
        for index, length in enumerate(lengths):
            axes.scatter([], [], color="grey", marker=MARKERS[index % len(MARKERS)], label=f"gen_length {length}")
    frontier = pareto_frontier([(row.tps, _accuracy(row) * 100) for row in scored])
    if len(frontier) > 1:  # one point that beats all others draws no line
        axes.plot([tps for tps, _ in frontier], [acc for _, acc in frontier], color="grey", linestyle="--",
                  linewidth=1, zorder=2, label="frontier")
    accuracies = [_accuracy(row) * 100 for row in scored]
    low, high = max(0.0, min(accuracies) - 5), min(100.0, max(accuracies) + 5) if max(accuracies) > 0 else 5
    margin = (high - low) * 0.05  # a point at 0 or 100 % is drawn whole, not cut by the frame
    axes.set_ylim(low - margin, high + margin)
    _log_scale_if_wide(axes, [row.tps for row in scored], axis="x")
    axes.set_xlabel("tokens per second (batch 1)")
    axes.set_ylabel("accuracy (%)")
    axes.set_title("Accuracy against decoding speed")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)  # outside: covers no point
    return figure


def plot_sweep_frontier(points: Sequence[FrontierPoint], path: Path, speed: str = "tps") -> bool:
    """Accuracy (%) against ``speed`` ("tps" or "tpf"); False (and no file) without points."""
    return _save(sweep_frontier_figure(points, speed), path)


def sweep_frontier_figure(points: Sequence[FrontierPoint], speed: str):
    """The sweep frontier's figure, or None without points: a panel per length, a colour per decoder,
    each decoder's front (``on_front`` for TPS, ``on_front_tpf`` for TPF) a line with its settings named."""
    if not points:
        return None
    lengths = sorted({point.gen_length for point in points})
    figure, panels = _figure(8 * len(lengths) + 3.5, 6, columns=len(lengths))
    decoders = list(dict.fromkeys(point.decoder for point in points))
    for axes, length in zip(panels, lengths):
        here = [point for point in points if point.gen_length == length]
        for color, decoder in enumerate(decoders):
            mine = [point for point in here if point.decoder == decoder]
            if not mine:
                continue
            axes.scatter([getattr(p, speed) for p in mine], [p.accuracy * 100 for p in mine], color=f"C{color}",
                         marker=MARKERS[color % len(MARKERS)], s=40, alpha=0.6, zorder=3,
                         label=decoder)
            front = sorted((p for p in mine if (p.on_front if speed == "tps" else p.on_front_tpf)),
                           key=lambda p: getattr(p, speed))
            axes.plot([getattr(p, speed) for p in front], [p.accuracy * 100 for p in front], color=f"C{color}",
                      linewidth=1.5, zorder=2)
            for p in front:
                axes.annotate(p.setting, (getattr(p, speed), p.accuracy * 100), fontsize=6, xytext=(3, 3),
                              textcoords="offset points", color=f"C{color}")
        _log_scale_if_wide(axes, [getattr(p, speed) for p in here], axis="x")
        axes.set_ylim(-5, 105)
        axes.set_xlabel(SPEED_AXES[speed])
        axes.set_ylabel("accuracy (%)")
        axes.set_title(f"gen_length {length}: every setting; lines: each decoder's front", fontsize=9)
        axes.grid(alpha=0.3)
    legend: dict[str, Any] = {}  # label -> handle, over every panel (a decoder may miss a length)
    for axes in panels:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    figure.legend(list(legend.values()), list(legend), fontsize=8, loc="outside right upper")
    return figure


def plot_length_sweep(rows: Sequence[BenchRow], path: Path) -> bool:
    """TPS and p50 latency against gen_length, one line per decoder; False (and no file) when the
    rows hold fewer than two lengths (a single length is no sweep: the table says it all)."""
    return _save(length_figure(rows), path)


def length_figure(rows: Sequence[BenchRow]):
    """The length plot's figure, or None with fewer than two lengths; the legend sits right of both axes."""
    rows = [row for row in rows if row.batch_size == 1]  # TPS at batch 1 only
    lengths = sorted({row.gen_length for row in rows})
    if len(lengths) < 2:
        return None
    figure, (tps_axes, latency_axes) = _figure(10, 4, columns=2)
    for color, label in enumerate(_labels(rows)):
        mine = sorted((row for row in rows if row.decoder == label), key=lambda row: row.gen_length)
        x = [row.gen_length for row in mine]
        tps_axes.plot(x, [row.tps for row in mine], marker="o", color=f"C{color}", label=label)
        latency_axes.plot(x, [row.latency_p50_ms for row in mine], marker="o", color=f"C{color}", label=label)
    for axes, ylabel in ((tps_axes, "tokens per second"), (latency_axes, "median latency per decode (ms)")):
        axes.set_xscale("log", base=2)
        _log_scale_if_wide(axes, [value for line in axes.get_lines() for value in line.get_ydata()])
        axes.set_xticks(lengths, [str(length) for length in lengths])
        axes.set_xlabel("response length budget (gen_length)")
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
    tps_axes.set_title("Speed against response length")
    latency_axes.set_title("Latency against response length")
    figure.legend(*tps_axes.get_legend_handles_labels(), fontsize=8, loc="outside right upper")  # covers no line
    return figure


def _accuracy(row: BenchRow) -> float:
    """A scored row's accuracy (the rows plotted are those that have one)."""
    assert row.accuracy is not None
    return row.accuracy
