"""An OpenAI-compatible server under load: the bench's prompts as streamed chat requests, a set number in flight.

Contract:

- :func:`parse_endpoint` reads ``URL[=NAME]`` (``http(s)://host[:port][/prefix][/v1]``); :func:`resolve_endpoint`
  asks the server's ``GET /v1/models`` which model ids it serves and checks NAME against them (no NAME: the one
  model it serves).
- :func:`load_level` sends ``requests`` chat requests (``stream``, ``stream_options.include_usage``,
  ``temperature`` 0, ``max_tokens``, ``seed`` = seed + the prompt's index), at most ``concurrency`` at a time,
  prompt ``i % len(prompts)`` as request ``i``; no request starts after ``max_seconds`` (those in flight end).
  Each :class:`Reply` holds what the client saw: the text, when each content chunk came, the usage.
- A server that cannot be reached, answers with an error, stops mid-stream or sends what is not an OpenAI
  reply is a :class:`~refusion_cli.errors.UserError` of one line naming the endpoint.

The client knows nothing of tokens or answers: counting and scoring are :mod:`refusion_cli.bench.served`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from refusion_cli.errors import UserError

REQUEST_TIMEOUT_S = 300.0  # the longest wait for a chunk
CONNECT_TIMEOUT_S = 10.0
ROUTE_SUFFIXES = ("/v1/chat/completions", "/v1")  # stripped from a given URL: the routes are below its base


@dataclass(frozen=True)
class Endpoint:
    base: str  # scheme://host:port[/prefix]; the routes are base + /v1/...
    model: str | None  # the model id requests name; None: the server's only one (resolve_endpoint)
    given: str  # URL[=NAME] as the user wrote it

    @property
    def address(self) -> str:
        return urlsplit(self.base).netloc


@dataclass
class Reply:
    """What the client saw of one streamed request; times in seconds from the request's start."""

    index: int  # the prompt's
    request: int  # the request's number in its level
    text: str
    latency: float
    chunk_times: list[float] = field(default_factory=list)  # each chunk with content
    usage: dict[str, Any] | None = None  # the last usage the server sent (include_usage: the final chunk's)
    usage_tokens: int | None = None  # its completion_tokens
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        """Time to the first content chunk (the whole latency for an empty answer)."""
        return self.chunk_times[0] if self.chunk_times else self.latency


@dataclass
class LevelRun:
    """One concurrency level: its replies in the order they finished and its wall time."""

    concurrency: int
    replies: list[Reply]
    seconds: float
    stopped_by_time: bool  # max_seconds passed before every request had started


def parse_endpoint(text: str) -> Endpoint:
    """``URL[=NAME]`` -> an :class:`Endpoint` (the URL's ``/v1`` or ``/v1/chat/completions`` tail dropped)."""
    url, equals, name = text.strip().partition("=")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--endpoint '{text}' is not an http(s) URL",
                        hint="give URL[=NAME], e.g. --endpoint http://127.0.0.1:8000=refusion")
    if equals and not name.strip():
        raise UserError(f"--endpoint '{text}' names no model after '='", hint="give URL=NAME or the URL alone")
    path = parts.path.rstrip("/")
    for suffix in ROUTE_SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    return Endpoint(f"{parts.scheme}://{parts.netloc}{path}", name.strip() or None, text.strip())


def resolve_endpoint(endpoint: Endpoint) -> Endpoint:
    """The endpoint with its model id checked against (or taken from) the server's ``GET /v1/models``."""
    url = f"{endpoint.base}/v1/models"
    try:
        response = httpx.get(url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach the endpoint {endpoint.base}: {reason(exc)}",
                        hint="is the server running, at that address?") from None
    ids = model_ids(response) if response.status_code == 200 else None
    if ids is None:
        answer = (f"HTTP {response.status_code}, {error_message(response.text)}" if response.status_code != 200
                  else "no model list")
        raise UserError(f"{endpoint.base} is not an OpenAI-compatible server: GET /v1/models answered {answer}")
    if endpoint.model is None:
        if len(ids) != 1:
            raise UserError(f"{endpoint.base} serves {', '.join(ids) or 'no model'}: name the one to load",
                            hint=f"--endpoint {endpoint.base}=NAME")
        return Endpoint(endpoint.base, ids[0], endpoint.given)
    if endpoint.model not in ids:
        raise UserError(f"{endpoint.base} serves no model '{endpoint.model}'; it serves {', '.join(ids) or 'none'}")
    return endpoint


def model_ids(response: httpx.Response) -> list[str] | None:
    """The ids of an OpenAI model list, or None when the body is not one."""
    try:
        data = response.json()["data"]
        ids = [entry["id"] for entry in data]
    except (ValueError, KeyError, TypeError):
        return None
    return ids if all(isinstance(name, str) for name in ids) else None


def reason(exc: BaseException) -> str:
    """A transport error in a few words (httpx's own text can be empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def error_message(body: str) -> str:
    """An OpenAI error body's message, else the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(body.split())[:160] or "(empty body)"


class RequestFailed(Exception):
    """One request did not give an OpenAI answer; the message says why."""


def request_body(model: str, prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}


async def send(client: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], index: int,
               request: int) -> Reply:
    """One streamed chat request, as the client times it."""
    start = time.perf_counter()
    reply = Reply(index, request, "", 0.0)
    texts: list[str] = []
    events, done = 0, False
    async with client.stream("POST", f"{endpoint.base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            body_text = (await response.aread()).decode(errors="replace")
            raise RequestFailed(f"HTTP {response.status_code}: {error_message(body_text)}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data, events = line[5:].strip(), events + 1
            if data == "[DONE]":
                done = True
                break
            chunk = parse_chunk(data)
            if chunk.get("usage"):
                reply.usage, reply.usage_tokens = chunk["usage"], usage_tokens(chunk["usage"])
            for choice in chunk["choices"]:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    texts.append(content)
                    reply.chunk_times.append(time.perf_counter() - start)
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    if not done:
        raise RequestFailed("the stream ended before 'data: [DONE]'" if events
                            else "not an OpenAI stream: no 'data:' events in the reply")
    reply.latency = time.perf_counter() - start
    reply.text = "".join(texts)
    return reply


def parse_chunk(data: str) -> dict[str, Any]:
    """One SSE event's JSON, checked to be a chat completion chunk (an error event fails the request)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RequestFailed(f"not an OpenAI stream: {data[:80]!r}") from None
    if isinstance(chunk, dict) and "error" in chunk:
        raise RequestFailed(f"the stream ended with an error: {error_message(data)}")
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        raise RequestFailed(f"not an OpenAI chat completion chunk: {data[:80]!r}")
    return chunk


def usage_tokens(usage: Any) -> int:
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or tokens < 0:
        raise RequestFailed(f"a usage without a completion_tokens count: {usage!r}"[:160])
    return tokens


async def run_level(endpoint: Endpoint, prompts: Sequence[str], concurrency: int, requests: int,
                    max_seconds: float | None, max_tokens: int, seed: int) -> LevelRun:
    """``requests`` requests, ``concurrency`` workers each sending its next one when its last has ended."""
    assert endpoint.model is not None
    replies: list[Reply] = []
    started = 0
    start = time.perf_counter()
    deadline = None if max_seconds is None else start + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal started
        while started < requests and (deadline is None or time.perf_counter() < deadline):
            request, started = started, started + 1
            index = request % len(prompts)
            body = request_body(endpoint.model or "", prompts[index], max_tokens, seed + index)
            replies.append(await send(client, endpoint, body, index, request))

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(min(concurrency, requests))]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return LevelRun(concurrency, replies, time.perf_counter() - start, started < requests)


def load_level(endpoint: Endpoint, prompts: Sequence[str], concurrency: int, requests: int,
               max_seconds: float | None, max_tokens: int, seed: int) -> LevelRun:
    """:func:`run_level` on an event loop of its own; a failed request is a UserError naming the endpoint."""
    where = f"{endpoint.model} at {endpoint.base}, concurrency {concurrency}"
    try:
        return asyncio.run(run_level(endpoint, prompts, concurrency, requests, max_seconds, max_tokens, seed))
    except RequestFailed as exc:
        raise UserError(f"{where}: {exc}") from None
    except httpx.HTTPError as exc:
        raise UserError(f"{where}: the server stopped answering ({reason(exc)})") from None
