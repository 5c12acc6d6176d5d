"""Load benchmark of ``refusion serve``: the same prompts sent by 1, 4 and 16 concurrent clients (streamed chat
requests to 127.0.0.1, through ``refusion bench --endpoint``'s client, :mod:`refusion_cli.bench.endpoint`), beside
the decoders run offline in this process on the same prompts: batch 1 one after the other (what ``refusion chat``
does per question) and ``--batch-size 16`` (what ``refusion bench --batch-size 16`` runs). Writes ``load.md``
and ``load.json`` to ``--output``.

Beside throughput, latency and time to the first chunk with text (TTFT), the served levels give ITL (the gap
between two content chunks), TPOT (a request's time after its first chunk over its tokens after the first) and
the decoders' figures from each answer's ``usage``: model calls per request, tokens committed per call and per
chunk (a ReFusion step commits several tokens in one chunk, so its ITL is a step's time, not a token's).

    python -m tools.serve_load --output results/serve

Bounded: a fixed number of requests per level, each with a timeout, against a server this script starts on a
free port of 127.0.0.1 and stops. Run it on an otherwise idle machine: the server and the offline runs share
its cores (they take turns; nothing overlaps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

@dataclass
class Level:
    """One measured way of answering the prompts."""

    name: str
    clients: int  # concurrent requests (offline: rows decoded together)
    requests: int
    tokens: int
    seconds: float  # wall time of the whole level
    latency_p50: float
    latency_p95: float
    ttfb_p50: float | None  # time to the first chunk with text (None offline)
    ttfb_p95: float | None
    forwards_per_request: float = 0.0  # model calls per request (the toolkit's forwards)
    tokens_per_forward: float = 0.0
    itl_p50: float | None = None  # streamed: the median gap between two content chunks
    tpot_p50: float | None = None  # streamed: (latency - first chunk) / (tokens - 1), the median over requests
    tokens_per_chunk: float | None = None  # streamed: tokens committed per content chunk

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def level(name: str, clients: int, tokens: int, seconds: float, latencies: list[float],
          ttfbs: list[float] | None = None, forwards: int = 0) -> Level:
    return Level(name, clients, len(latencies), tokens, seconds, statistics.median(latencies),
                 percentile(latencies, 0.95), None if ttfbs is None else statistics.median(ttfbs),
                 None if ttfbs is None else percentile(ttfbs, 0.95), forwards / len(latencies),
                 tokens / forwards if forwards else 0.0)


# --- the servers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(command: list[str], env: dict[str, str], base: str, log: Path | None = None,
           timeout: float = 300) -> subprocess.Popen:
    """``command`` (a server) started with its output to ``log``, returned once ``base``/health answers 200; a
    server that exits or is not up within ``timeout`` seconds is stopped and ends the script."""
    out = subprocess.DEVNULL if log is None else log.open("w")
    server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while not up(base):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {shlex.join(command[:4])} ... (log: {log})")
            time.sleep(0.2)
    except BaseException:  # Ctrl-C too: no server is left behind
        server.kill()
        server.wait()
        raise
    return server


def up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health").status_code == 200
    except httpx.TransportError:
        return False


def start_server(model: str, decoders: list[str], max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    """``refusion serve`` of ``decoders`` on ``model`` at a free port of 127.0.0.1, once it answers /health."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    base = f"http://127.0.0.1:{port}"
    return launch([sys.executable, "-m", "refusion_cli", "serve", "--model", model, "--decoder", *decoders,
                   "--port", str(port), "--max-batch", str(max_batch)], env, base), base


def served_level(base: str, decoder: str, questions: list[str], max_tokens: int, clients: int) -> Level:
    """``clients`` streamed requests in flight at a time through the bench's client
    (:mod:`refusion_cli.bench.endpoint`), each question once."""
    from refusion_cli.bench.endpoint import Endpoint, load_level

    run = load_level(Endpoint(base, decoder, base), questions, clients, len(questions), None, max_tokens, 0)
    replies = run.replies
    usages = [reply.usage or {} for reply in replies]
    result = level(f"serve, {clients} client{'s' if clients > 1 else ''}, streamed", clients,
                   sum(usage.get("completion_tokens", 0) for usage in usages), run.seconds,
                   [reply.latency for reply in replies], [reply.ttft for reply in replies],
                   sum(usage.get("forwards", 0) for usage in usages))
    gaps = [later - earlier for reply in replies for earlier, later in zip(reply.chunk_times, reply.chunk_times[1:])]
    tpots = [(reply.latency - reply.ttft) / (usage["completion_tokens"] - 1)
             for reply, usage in zip(replies, usages) if usage["completion_tokens"] > 1]
    result.itl_p50 = statistics.median(gaps) if gaps else None  # None: one chunk per answer
    result.tpot_p50 = statistics.median(tpots) if tpots else None
    result.tokens_per_chunk = result.tokens / sum(len(reply.chunk_times) for reply in replies)
    return result


# --- offline, in this process ------------------------------------------------------------------


def offline_levels(model: str, decoder: str, questions: list[str], max_tokens: int, batch_size: int,
                   threads: int) -> list[Level]:
    import torch

    from refusion_cli.decoding.engine import run_decoder
    from refusion_cli.decoding.spec import default_config
    from refusion_cli.models.chat import user_prompt_ids
    from refusion_cli.models.loading import load_model

    torch.set_num_threads(threads)
    loaded = load_model(model, "cpu")
    config = default_config(decoder, model, max_tokens)  # what refusion serve and chat run on this model
    special = {"mask_token_id": loaded.mask_token_id, "eos_token_id": loaded.stop_token_ids}
    run_decoder(decoder, loaded.model, user_prompt_ids(loaded.tokenizer, questions[0]), config, **special)  # warm-up
    latencies, tokens, forwards = [], 0, 0
    start = time.perf_counter()
    for question in questions:  # what refusion chat does per question: render, decode, detokenize
        began = time.perf_counter()
        result = run_decoder(decoder, loaded.model, user_prompt_ids(loaded.tokenizer, question), config,
                             generator=torch.Generator().manual_seed(0), **special)
        loaded.tokenizer.decode(result.tokens, skip_special_tokens=True)
        latencies.append(time.perf_counter() - began)
        tokens += result.stats.tokens
        forwards += result.stats.forwards
    alone = level("in process, batch 1 (chat)", 1, tokens, time.perf_counter() - start, latencies, forwards=forwards)
    prompts = [user_prompt_ids(loaded.tokenizer, question) for question in questions]
    start = time.perf_counter()
    results = run_decoder(decoder, loaded.model, prompts, config, batch_size=batch_size,
                          generator=[torch.Generator().manual_seed(0) for _ in prompts], **special)
    seconds = time.perf_counter() - start
    batched = level(f"in process, --batch-size {batch_size} (bench)", batch_size, sum(r.stats.tokens for r in results),
                    seconds, [r.stats.seconds for r in results], forwards=sum(r.stats.forwards for r in results))
    return [alone, batched]


# --- report ------------------------------------------------------------------------------------


def report(levels: list[Level], args: argparse.Namespace, command: str) -> str:
    by_name = {entry.name: entry for entry in levels}
    chat = by_name["in process, batch 1 (chat)"]
    bench = next(entry for entry in levels if entry.name.startswith("in process, --batch-size"))
    served = [entry for entry in levels if entry.name.startswith("serve")]
    most = max(args.clients)
    ms = lambda seconds: "" if seconds is None else f"{1000 * seconds:.0f}"  # noqa: E731
    lines = [
        f"# `refusion serve` under load: {args.decoder} on {args.model}",
        "",
        f"Command: `{command}`",
        "",
        f"{args.prompts} synthetic questions (chat template), max_tokens {args.max_tokens}, streamed chat requests, "
        f"server `--max-batch {args.batch_size}`, {args.threads} torch thread(s); {platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} cores. One run; the ratios compare levels of this run.",
        "",
        "| level | clients | tokens | seconds | throughput (tokens/s) | latency p50 / p95 (ms) | TTFT p50 / p95 (ms) "
        "| ITL p50 (ms) | TPOT p50 (ms) | model calls / request | tokens / call | tokens / chunk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in levels:
        first = "" if entry.ttfb_p50 is None else f"{ms(entry.ttfb_p50)} / {ms(entry.ttfb_p95)}"
        itl = "" if entry.itl_p50 is None else f"{1000 * entry.itl_p50:.1f}"
        tpot = "" if entry.tpot_p50 is None else f"{1000 * entry.tpot_p50:.1f}"
        per_chunk = "" if entry.tokens_per_chunk is None else f"{entry.tokens_per_chunk:.2f}"
        lines.append(f"| {entry.name} | {entry.clients} | {entry.tokens} | {entry.seconds:.2f} | {entry.throughput:.1f} "
                     f"| {ms(entry.latency_p50)} / {ms(entry.latency_p95)} | {first} | {itl} | {tpot} "
                     f"| {entry.forwards_per_request:.1f} | {entry.tokens_per_forward:.2f} | {per_chunk} |")
    lines.append("")
    for entry in served:
        if entry.clients == most:
            lines.append(f"- {entry.name}: throughput / offline `--batch-size {bench.clients}`: "
                         f"**{entry.throughput / bench.throughput:.2f}×**")
        if entry.clients == 1:
            lines.append(f"- {entry.name}: mean latency / in-process batch 1 (chat): "
                         f"**{(entry.seconds / entry.requests) / (chat.seconds / chat.requests):.2f}×** "
                         f"({1000 * entry.seconds / entry.requests:.0f} ms against "
                         f"{1000 * chat.seconds / chat.requests:.0f} ms per request)")
    lines += [
        "",
        "Latency is measured by the client (request sent to `[DONE]` read) for the server and around the render, "
        "decode and detokenize of each question in process. The offline batch's latency is each row's decode "
        "latency from its admission. TTFT is the time to the first chunk with text. ITL is the gap "
        "between two content chunks; a ReFusion chunk carries a step's commits "
        "(tokens / chunk), so ITL is a step's time and TPOT (time after the first chunk over the tokens after the "
        "first) the time per token.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="refusion-tiny")
    parser.add_argument("--decoder", default="refusion")
    parser.add_argument("--prompts", type=int, default=32, help="requests per level (the first N synthetic questions)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batch-size", type=int, default=16, help="the server's --max-batch and the offline batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/serve"))
    args = parser.parse_args()
    command = "python -m tools.serve_load " + shlex.join(sys.argv[1:])

    from refusion_cli.harness.suite import EVALS_DIR
    from refusion_cli.tasks.synthetic import read_jsonl

    questions = [problem["question"] for problem in read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[:args.prompts]]
    levels = offline_levels(args.model, args.decoder, questions, args.max_tokens, args.batch_size, args.threads)
    server, base = start_server(args.model, [args.decoder], args.batch_size, args.threads)
    try:
        from refusion_cli.bench.endpoint import Endpoint, load_level

        load_level(Endpoint(base, args.decoder, base), questions, 1, 1, None, args.max_tokens, 0)  # warm-up
        for clients in args.clients:
            levels.append(served_level(base, args.decoder, questions, args.max_tokens, clients))
            print(levels[-1].name, f"{levels[-1].throughput:.1f} tokens/s", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    args.output.mkdir(parents=True, exist_ok=True)
    text = report(levels, args, command)
    (args.output / "load.md").write_text(text, encoding="utf-8")
    (args.output / "load.json").write_text(json.dumps({"command": command, "levels": [
        {**asdict(entry), "throughput": entry.throughput} for entry in levels]}, indent=2) + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
