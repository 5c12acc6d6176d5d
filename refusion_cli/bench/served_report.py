"""The report of ``refusion bench --endpoint``: ``served.md`` (the settings, the table, the crossovers) and
``served.png``, total throughput against what one request sees, one curve per row over its concurrency levels
(the serving papers' picture). matplotlib's object API, as :mod:`refusion_cli.bench.plots`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from refusion_cli.bench.plots import MARKERS, _figure, _log_scale_if_wide, _save, plotting_available
from refusion_cli.bench.report import fmt, percent
from refusion_cli.bench.served import ROWS_FILE, SAMPLES_FILE, ServedRow, ServedRun, crossovers

REPORT_FILE = "served.md"
PLOT_FILE = "served.png"
HEADER = ["endpoint", "kind", "concurrency", "requests", "output tok/s", "req/s", "tok/s per request (p50)",
          "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms", "TPOT p99 ms", "tokens/chunk",
          "accuracy"]


def write_report(output: Path, run: ServedRun) -> list[str]:
    """served.md and (with matplotlib and rows) served.png; the names written."""
    written = []
    if plotting_available() and _save(served_figure(run.rows), output / PLOT_FILE):
        written.append(PLOT_FILE)
    (output / REPORT_FILE).write_text(markdown(run, plot=bool(written)), encoding="utf-8")
    return [ROWS_FILE, SAMPLES_FILE, REPORT_FILE, *written]


def markdown(run: ServedRun, plot: bool) -> str:
    settings = run.settings
    requests = settings.max_requests or run.n_prompts
    bound = f"{settings.max_seconds:g} s" if settings.max_seconds is not None else "no time bound"
    lines = ["# Served benchmark", ""]
    if run.interrupted:
        lines += [f"**Interrupted:** {run.interrupted}. The levels measured before are below.", ""]
    lines += [
        "Endpoints: " + ", ".join(f"`{endpoint}`" for endpoint in run.endpoints) + ".",
        "",
        f"Prompts: {run.prompts_source}; {requests} streamed chat requests per level (prompt i mod "
        f"{run.n_prompts}), at most `concurrency` in flight, no request started after {bound}; max_tokens "
        f"{settings.max_tokens}, temperature 0, seed {settings.seed} + the prompt's index; {settings.warmup} "
        "untimed request(s) to each endpoint first. Tokens: " + run.counting + ".",
        "",
        "Output tok/s and req/s are over the level's wall time; tok/s per request is a request's tokens over its "
        "latency; TTFT is the time to the first chunk with text, ITL the gap between two such chunks (a decoder "
        "that commits several tokens a step sends them in one chunk), TPOT a request's time after its first "
        "chunk over its tokens after the first. Accuracy: the synthetic task's rule (`is_correct`), as `refusion "
        "bench` and `refusion eval` score.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for row in run.rows:
        requests_cell = f"{row.requests}{' (time bound)' if row.stopped_by_time else ''}"
        cells = [row.endpoint, row.kind, str(row.concurrency), requests_cell, fmt(row.throughput, 1),
                 fmt(row.requests_per_s), fmt(row.user_tps_p50, 1), fmt(row.ttft_p50_ms, 0), fmt(row.ttft_p99_ms, 0),
                 fmt(row.itl_p50_ms, 1), fmt(row.itl_p99_ms, 1), fmt(row.tpot_p50_ms, 1), fmt(row.tpot_p99_ms, 1),
                 fmt(row.tokens_per_chunk), percent(row.accuracy)]
        lines.append("| " + " | ".join(cells) + " |")
    found = crossovers(run.rows)
    if found:
        lines += ["", "## Crossover", "", "The highest concurrency at which the dLLM's output tokens/s are still "
                  "above the AR row's (dLLM throughput ÷ AR throughput at each level):", ""]
        lines += [f"- {crossover.line()}" for crossover in found]
    if plot:
        lines += ["", f"![throughput against tokens/s per request]({PLOT_FILE})"]
    return "\n".join(lines) + "\n"


def served_figure(rows: Sequence[ServedRow]):
    """Output tokens/s against a request's tokens/s (p50), a curve per row through its levels, each point
    labelled with its concurrency; None without rows."""
    if not rows:
        return None
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    figure, (axes,) = _figure(8, 5)
    labels = list(dict.fromkeys(row.endpoint for row in rows))
    for color, label in enumerate(labels):
        mine = sorted((row for row in rows if row.endpoint == label), key=lambda row: row.concurrency)
        x, y = [row.user_tps_p50 for row in mine], [row.throughput for row in mine]
        axes.plot(x, y, marker=MARKERS[color % len(MARKERS)], color=f"C{color}", label=f"{label} ({mine[0].kind})")
        for row in mine:
            axes.annotate(str(row.concurrency), (row.user_tps_p50, row.throughput), fontsize=7, xytext=(4, 3),
                          textcoords="offset points", color=f"C{color}")
    _log_scale_if_wide(axes, [row.user_tps_p50 for row in rows], axis="x")
    _log_scale_if_wide(axes, [row.throughput for row in rows])
    for axis, scale in ((axes.xaxis, axes.get_xscale()), (axes.yaxis, axes.get_yscale())):
        if scale == "log":  # ticks at 1, 2 and 5 of each decade, as plain numbers
            axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())
    axes.set_xlabel("tokens per second per request (median)")
    axes.set_ylabel("output tokens per second (all requests)")
    axes.set_title("Served throughput against per-request speed (points: concurrency)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    return figure
