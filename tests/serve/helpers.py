"""An in-process ``refusion serve`` on 127.0.0.1 (uvicorn in a thread, a free port), and the answers the
same decoders give in process, batch 1, for comparison."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import torch
import uvicorn

from refusion_cli.decoding.registry import run_decoder
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


def served(decoders: list[str], overrides: dict[str, Any] | None = None,
           variants: list[Variant] = ()) -> dict[str, ServedModel]:
    entries = [ServedModel(served_id(d, PAPER), DecoderChoice(d, None, None, dict(overrides or {}))) for d in decoders]
    entries += [ServedModel(served_id("refusion", v), DecoderChoice("refusion", None, None, dict(overrides or {})), v)
                for v in variants]
    return {entry.id: entry for entry in entries}


@contextmanager
def running_server(loaded: LoadedModel, models: dict[str, ServedModel], *, max_batch: int = 16,
                   max_queue: int = 64, api_key: str | None = None) -> Iterator[tuple[str, ServerState]]:
    """The base URL (``http://127.0.0.1:PORT``) of a server on ``loaded``, stopped on exit."""
    metrics = ServeMetrics()
    state = ServerState(loaded, "test-model", models, Scheduler(loaded, max_batch=max_batch, max_queue=max_queue,
                                                                stats=metrics), metrics, api_key=api_key)
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
    text = httpx.get(f"{base}/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
