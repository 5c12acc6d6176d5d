"""Load benchmark of ``refusion serve``: the same prompts sent by 1, 4 and 16 concurrent clients (streamed chat
requests to 127.0.0.1), beside the decoders run offline in this process on the same prompts: batch 1 one after
the other (what ``refusion chat`` does per question) and ``--batch-size 16`` (what ``refusion bench --batch-size
16`` runs). Writes ``load.md`` and ``load.json`` to ``--output``.

Beside throughput, latency and time to first byte, the streamed levels give ITL (the gap between two content
chunks), TPOT (a request's time after its first chunk over its tokens after the first) and the decoders'
figures from each answer's ``usage``: model calls per request, tokens committed per call and per chunk
(a ReFusion step commits several tokens in one chunk, so its ITL is a step's time, not a token's).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REQUEST_TIMEOUT_S = 300
# one client with a pool of kept-alive connections, as the openai client keeps: a new httpx client per request
# would bill a TLS context and a TCP connection to every request
CLIENT = httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


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
    ttfb_p50: float | None  # time to the first streamed byte (None offline)
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


@dataclass
class Answer:
    """What a client measured of one request."""

    latency: float
    first: float  # time to the first byte
    tokens: int
    forwards: int
    gaps: list[float]  # streamed: seconds between consecutive content chunks
    chunks: int  # streamed: content chunks


# --- the server -------------------------------------------------------------------------------


def start_server(model: str, decoders: list[str], max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    """``refusion serve`` of ``decoders`` on ``model`` at a free port of 127.0.0.1, once it answers /health."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "refusion_cli", "serve", "--model", model, "--decoder", *decoders,
                               "--port", str(port), "--max-batch", str(max_batch)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return server, base
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.1)


def ask(base: str, decoder: str, question: str, max_tokens: int, stream: bool = True) -> Answer:
    """One chat request, streamed or not, as its client measures it."""
    body = {"model": decoder, "max_tokens": max_tokens, "messages": [{"role": "user", "content": question}]}
    start = time.perf_counter()
    if not stream:
        response = CLIENT.post(f"{base}/v1/chat/completions", json=body)
        response.raise_for_status()
        latency = time.perf_counter() - start
        usage = response.json()["usage"]
        return Answer(latency, latency, usage["completion_tokens"], usage["forwards"], [], 0)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    first, usage, times = None, {}, []
    with CLIENT.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - start
            first = now if first is None else first
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(now)
            else:
                usage = chunk["usage"]
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    return Answer(time.perf_counter() - start, first or 0.0, usage["completion_tokens"], usage["forwards"], gaps,
                  usage["stream_chunks"])


def served_level(base: str, decoder: str, questions: list[str], max_tokens: int, clients: int, stream: bool) -> Level:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda q: ask(base, decoder, q, max_tokens, stream), questions))
    seconds = time.perf_counter() - start
    kind = "streamed" if stream else "not streamed"
    result = level(f"serve, {clients} client{'s' if clients > 1 else ''}, {kind}", clients,
                   sum(a.tokens for a in answers), seconds, [a.latency for a in answers], [a.first for a in answers],
                   sum(a.forwards for a in answers))
    if stream:
        result.itl_p50 = statistics.median(gap for a in answers for gap in a.gaps)
        result.tpot_p50 = statistics.median((a.latency - a.first) / (a.tokens - 1) for a in answers if a.tokens > 1)
        result.tokens_per_chunk = result.tokens / sum(a.chunks for a in answers)
    return result


# --- offline, in this process ------------------------------------------------------------------


def offline_levels(model: str, decoder: str, questions: list[str], max_tokens: int, batch_size: int,
                   threads: int) -> list[Level]:
    import torch

    from refusion_cli.decoding.engine import run_decoder
    from refusion_cli.decoding.spec import DecoderChoice
    from refusion_cli.models.chat import user_prompt_ids
    from refusion_cli.models.loading import load_model

    torch.set_num_threads(threads)
    loaded = load_model(model, "cpu")
    config = DecoderChoice(decoder).config(max_tokens)
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
        f"{args.prompts} synthetic questions (chat template), max_tokens {args.max_tokens}, chat requests (streamed and not), "
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
        "latency from the start of the batch. TTFT is the time to the first byte: the first streamed chunk, or the "
        "whole answer. ITL is the gap between two content chunks; a ReFusion chunk carries a step's commits "
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
        ask(base, args.decoder, questions[0], args.max_tokens)  # warm-up
        for stream in (False, True):
            for clients in args.clients:
                levels.append(served_level(base, args.decoder, questions, args.max_tokens, clients, stream))
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
