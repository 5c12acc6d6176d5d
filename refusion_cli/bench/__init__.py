"""The speed benchmark behind ``refusion bench --tps``.

prompts.py  which prompts are decoded (the synthetic task, or a JSONL file)
runner.py   what is measured and how: settings, the rows to run, the timed decodes
figures.py  a row's summary figures: means, percentiles, its config in one line
counts.py   --counts: host syncs per engine step, attention calls per layer, positions and K/V copies
sweep.py    --sweep: each decoder over a grid of its parallelism settings, a row per setting
machine.py  what it ran on, and the peak-memory measurement
report.py   the CSV rows (written as they are measured, read back to resume), the Markdown report
resume.py   run.json, and continuing an interrupted run (--resume) after checking it is the same run
frontier.py a --sweep run's accuracy/speed frontier: its points, their Pareto fronts, frontier.csv
plots.py    accuracy-vs-TPS frontier, TPS and latency against the response length
endpoint.py --endpoint: the client that loads an OpenAI-compatible server at a concurrency and times each answer
served.py   --endpoint: a served row's figures, its answers scored as in-process rows are, the crossover
served_report.py  --endpoint: served.md and the plot of total against per-request tokens/s

Nothing here prints; ``refusion_cli.cli.bench`` drives it and owns the terminal.
"""

from refusion_cli.bench.prompts import BenchPrompt, load_prompts
from refusion_cli.bench.runner import BenchEntry, BenchRow, BenchSample, BenchSettings, plan_entries, run_bench

__all__ = ["BenchEntry", "BenchPrompt", "BenchRow", "BenchSample", "BenchSettings", "load_prompts", "plan_entries",
           "run_bench"]
