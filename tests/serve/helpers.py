"""An in-process ``refusion serve`` on 127.0.0.1 (uvicorn in a thread, a free port), ``refusion serve`` as a process
of its own, and the answers the same decoders give in process, batch 1, for comparison."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.spec import DecoderChoice
from refusion_cli.decoding.variants import PAPER, Variant, variant_options
from refusion_cli.harness.answers import stock_text
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import LoadedModel
from refusion_cli.serve.app import ServerState, create_app
from refusion_cli.serve.engine import Scheduler
from refusion_cli.serve.metrics import ServeMetrics
from refusion_cli.serve.protocol import ServedModel, served_id
from tests.ports import free_port

# The servers of these tests speak plain HTTP on 127.0.0.1, so every client here is made with verify=False: the
# default loads certifi's CA bundle for each httpx.get/post/stream, about 25 ms of CPU under the GIL, which the
# in-process server's thread waits out (most of a short request's cost).
REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = "test-model"  # the checkpoint name of a server on one model


def served(decoders: list[str], overrides: dict[str, Any] | None = None,
           variants: list[Variant] = (), checkpoint: str = CHECKPOINT) -> dict[str, ServedModel]:
    def choice(decoder: str) -> DecoderChoice:
        return DecoderChoice(decoder, checkpoint, None, dict(overrides or {}))
    entries = [ServedModel(served_id(d, PAPER), choice(d)) for d in decoders]
    entries += [ServedModel(served_id("refusion", v), choice("refusion"), v) for v in variants]
    return {entry.id: entry for entry in entries}


@contextmanager
def running_server(loaded: LoadedModel | dict[str, LoadedModel], models: dict[str, ServedModel], *,
                   max_batch: int = 16, max_queue: int = 64, api_key: str | None = None,
                   max_memory: int | None = None) -> Iterator[tuple[str, ServerState]]:
    """The base URL (``http://127.0.0.1:PORT``) of a server on ``loaded`` (one model, named ``CHECKPOINT``, or
    several by checkpoint name), stopped on exit."""
    metrics = ServeMetrics()
    checkpoints = loaded if isinstance(loaded, dict) else {CHECKPOINT: loaded}
    schedulers = {name: Scheduler(model, name, max_batch=max_batch, max_queue=max_queue, max_memory=max_memory,
                                  stats=metrics) for name, model in checkpoints.items()}
    state = ServerState(models, schedulers, metrics, api_key=api_key)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def scheduler(state: ServerState) -> Scheduler:
    """The scheduler of a server on one model."""
    return state.schedulers[CHECKPOINT]


@contextmanager
def serve_process(launcher: list[str], *options: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``refusion serve OPTIONS`` as a process of its own (``launcher``: how Python starts it) on a free port of
    127.0.0.1, once its /health answers; the process and its base URL, killed on exit if still running."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, *launcher, "serve", "--port", str(port), *options], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{base}/health", verify=False).status_code == 200
            except httpx.TransportError:
                assert server.poll() is None, server.stdout.read()
                return False
        wait_for(up, timeout=60)
        yield server, base
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def in_process(loaded: LoadedModel, entry: ServedModel, question: str, max_tokens: int, seed: int = 0,
               completion: bool = False, stops: list[str] = ()) -> tuple[str, int, int]:
    """The answer text, its token count and forwards that ``run_decoder`` gives alone (batch 1)."""
    prompt = (list(loaded.tokenizer(question, add_special_tokens=False)["input_ids"]) if completion
              else user_prompt_ids(loaded.tokenizer, question))
    result = run_decoder(entry.decoder, loaded.model, prompt, entry.config(max_tokens, {}),
                         mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids,
                         generator=torch.Generator().manual_seed(seed), **variant_options(entry.variant))
    return stock_text(loaded.tokenizer, result.tokens, list(stops)), result.stats.tokens, result.stats.forwards


def metric(base: str, name: str) -> float:
    """One sample of the server's /metrics (the sum over its labels)."""
    text = httpx.get(f"{base}/metrics", verify=False).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def decode_alone(loaded: LoadedModel, entry: ServedModel, prompt_ids: list[int], max_tokens: int, *, seed: int = 0,
                 eos: tuple[int, ...] | None = None) -> Any:
    """The ``DecodeResult`` of one prompt alone (batch 1); ``eos=()``: no end id (``ignore_eos``)."""
    return run_decoder(entry.decoder, loaded.model, prompt_ids, entry.config(max_tokens, {}),
                       mask_token_id=loaded.mask_token_id,
                       eos_token_id=loaded.stop_token_ids if eos is None else eos,
                       generator=torch.Generator().manual_seed(seed), **variant_options(entry.variant))


@dataclass
class Reply:
    """What a client reads of one request, streamed or not: text and finish_reason by choice index, the final
    usage, and (streamed) the chunks' own usage objects in order."""

    status: int
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    chunk_usages: list[dict[str, Any]] = field(default_factory=list)
    chunks: int = 0
    error: dict[str, Any] | None = None


def ask(base: str, body: dict[str, Any], *, chat: bool, stream: bool, timeout: float = 120) -> Reply:
    """POST ``body`` to chat or completions, streamed (``stream_options.include_usage``) or not."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True, **body.get("stream_options", {})}
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=timeout, verify=False) as response:
        if response.status_code != 200:
            response.read()
            return Reply(response.status_code, error=response.json()["error"])
        if not stream:
            response.read()
            data = response.json()
            reply = Reply(200, usage=data["usage"])
            for choice in data["choices"]:
                reply.texts[choice["index"]] = choice["message"]["content"] if chat else choice["text"]
                reply.finish[choice["index"]] = choice["finish_reason"]
            return reply
        reply = Reply(200)
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    for line in lines[:-1]:
        chunk = json.loads(line)
        if "error" in chunk:
            reply.error = chunk["error"]
            continue
        reply.chunks += 1
        if not chunk["choices"]:
            reply.usage = chunk["usage"]
            continue
        if chunk.get("usage") is not None:
            reply.chunk_usages.append(chunk["usage"])
        for choice in chunk["choices"]:
            text = choice["delta"].get("content") or "" if chat else choice["text"]
            reply.texts[choice["index"]] = reply.texts.get(choice["index"], "") + text
            if choice["finish_reason"] is not None:
                reply.finish[choice["index"]] = choice["finish_reason"]
    return reply


# the field tests' modes (chat, stream): chat streamed and completions whole by default, each endpoint and each way
# of answering once; chat whole and completions streamed under `make test-all`
FIELD_MODES = [pytest.param(True, False, id="chat", marks=pytest.mark.slow),
               pytest.param(True, True, id="chat-stream"),
               pytest.param(False, False, id="completion"),
               pytest.param(False, True, id="completion-stream", marks=pytest.mark.slow)]
