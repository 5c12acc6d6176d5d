"""The HTTP side of ``refusion serve``: routes that parse and validate a request, hand it to the
:class:`~refusion_cli.serve.engine.Scheduler`, and drain the job's events into an OpenAI response.

No model code runs here and no HTTP object reaches the engine: a job's events travel from the
scheduler thread to the route through an ``asyncio.Queue`` (``call_soon_threadsafe``), so a slow
client never holds the scheduler up. A streamed response whose client goes away cancels its job (its
row leaves before the next model call); so does a non-streamed one, checked twice a second.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` and the web view at ``/``. With an API key, the ``/v1`` routes need
``Authorization: Bearer KEY``. Every refusal is an OpenAI error object with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from refusion_cli.decoding.stats import DecodeStats
from refusion_cli.errors import UserError
from refusion_cli.models.loading import LoadedModel
from refusion_cli.serve.engine import Commits, Draining, Event, Failed, Finished, Job, QueueFull, Scheduler
from refusion_cli.serve.metrics import ServeMetrics
from refusion_cli.serve.protocol import ApiError, Generation, ServedModel, error_body, parse_generation
from refusion_cli.serve.text import PrefixText, answer_text

log = logging.getLogger("refusion.serve")
RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class ServerState:
    loaded: LoadedModel
    model_name: str  # the checkpoint as the user named it
    served: dict[str, ServedModel]
    scheduler: Scheduler
    metrics: ServeMetrics
    api_key: str | None = None
    seed: int = 0
    shutdown_timeout: float = 30.0


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.scheduler.start()
        yield
        finished = await asyncio.to_thread(state.scheduler.drain, state.shutdown_timeout)
        log.info("shut down: %s", "every request finished" if finished else "unfinished requests ended with an error")

    app = FastAPI(title="refusion serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("refusion_cli.serve").joinpath("page.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.model_name, "models": list(state.served),
                "running_rows": state.scheduler.rows, "queue_depth": state.scheduler.depth}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, state.api_key)
        return {"object": "list", "data": [model_card(entry, state.model_name) for entry in state.served.values()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, state, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, state, chat=False)

    return app


def run_server(state: ServerState, host: str, port: int) -> bool:
    """Serve until SIGTERM or Ctrl-C; False when the server could not start (the port taken, say).
    SIGTERM is a clean stop: uvicorn stops taking connections, lets the open ones finish, the
    scheduler drains (``shutdown_timeout``), and the process exits 0 (uvicorn would raise it again)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=state.shutdown_timeout + 5)
    server = Server(config)
    try:
        server.run()
    except SystemExit:  # uvicorn's way of saying it could not bind (logged above)
        return False
    return server.started


def check_address(host: str, port: int) -> None:
    """Refuse an address the server cannot listen on (a port in use, a host not of this machine) before the
    model loads: one error line rather than minutes of loading first."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}",
                            hint="is the port in use? pick another with --port") from None


def authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or token.strip() != api_key:
        raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'", code="invalid_api_key",
                       kind="authentication_error")


def model_card(entry: ServedModel, model_name: str) -> dict[str, Any]:
    return {"id": entry.id, "object": "model", "created": 0, "owned_by": "refusion",
            "decoder": entry.decoder, "checkpoint": model_name}


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


async def generate(request: Request, state: ServerState, *, chat: bool) -> Response:
    received = time.perf_counter()
    authorize(request, state.api_key)
    body = await read_json(request)
    generation = parse_generation(body, chat=chat, served=state.served, loaded=state.loaded, default_seed=state.seed)
    run = Run(generation, state, received)
    run.submit()
    if generation.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await run.answer(request))


class Run:
    """One request's job and the events it gets back."""

    def __init__(self, generation: Generation, state: ServerState, received: float):
        self.generation = generation
        self.state = state
        self.received = received
        self.id = ("chatcmpl-" if generation.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        self.job = Job(generation.served.decoder, generation.prompt_ids, generation.config, sink,
                       seed=generation.seed, variant=generation.served.variant, steps=generation.stream)
        self.text = PrefixText(state.loaded.tokenizer, state.loaded.stop_token_ids, generation.stops)
        self.first_byte: float | None = None

    def submit(self) -> None:
        try:
            self.state.scheduler.submit(self.job)
        except QueueFull:
            self.state.metrics.requests.labels("error").inc()
            raise ApiError(429, f"the queue is full ({self.state.scheduler.max_queue} requests wait); retry later",
                           code="queue_full", kind="rate_limit_error") from None
        except Draining:
            raise ApiError(503, "the server is shutting down", kind="server_error") from None

    # --- the whole answer ---------------------------------------------------------------------

    async def answer(self, request: Request) -> dict[str, Any]:
        while True:
            try:
                event = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    raise ApiError(499, "the client closed the request") from None
                continue
            if isinstance(event, Failed):
                self.done("error")
                raise ApiError(500, event.message, kind="server_error")
            if isinstance(event, Finished):
                self.mark_first_byte()
                self.done("ok")
                text = answer_text(self.state.loaded.tokenizer, event.result.tokens, self.generation.stops)
                return self.completion(text, event.result)

    def completion(self, text: str, result: Any) -> dict[str, Any]:
        finish = self.finish_reason(text, result)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.generation.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.generation.chat else "text_completion",
                "created": self.created, "model": self.generation.served.id, "choices": [choice],
                "usage": self.usage(result.stats)}

    # --- the stream ---------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[str]:
        finished = False
        held: Event | None = None  # an event read while gathering commits, handled next
        try:
            while True:
                event, held = (held, None) if held is not None else (await self.events.get(), None)
                if isinstance(event, Failed):
                    finished = True
                    self.done("error")
                    yield sse(error_body(event.message, "server_error"))
                    break
                if isinstance(event, Commits):
                    more, held = self.queued_commits()  # one chunk for the steps that queued up
                    commits = [*event.commits, *more]
                    delta = self.text.add(commits)
                    yield sse(self.chunk(delta, None, commits=commits))
                    self.mark_first_byte()
                    continue
                result = event.result  # Finished
                answer = answer_text(self.state.loaded.tokenizer, result.tokens, self.generation.stops)
                rest = self.text.finish(answer)
                if self.text.sent != answer:
                    log.warning("request %s: the streamed text is not the answer's", self.id)
                yield sse(self.chunk(rest, self.finish_reason(answer, result)))
                self.mark_first_byte()
                if self.generation.include_usage:
                    yield sse(self.usage_chunk(result.stats))
                finished = True
                self.done("ok")
                break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (the stream was closed early)
                self.cancel()

    def queued_commits(self) -> tuple[list[Any], Event | None]:
        """The commits of the steps already queued, and the first other event queued behind them."""
        commits: list[Any] = []
        while not self.events.empty():
            event = self.events.get_nowait()
            if not isinstance(event, Commits):
                return commits, event
            commits.extend(event.commits)
        return commits, None

    def chunk(self, delta: str, finish: str | None, commits: list[Any] | None = None) -> dict[str, Any]:
        chat = self.generation.chat
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = ({"role": "assistant"} if self.first_byte is None else {}) | (
                {"content": delta} if delta or finish is None else {})
        else:
            choice["text"] = delta
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": self.created, "model": self.generation.served.id, "choices": [choice]}
        if commits is not None:
            tokenizer = self.state.loaded.tokenizer
            body["commits"] = [{"offset": c.offset, "token": c.token, "kind": c.kind,
                                "text": tokenizer.decode([c.token], skip_special_tokens=False)} for c in commits]
        return body

    def usage_chunk(self, stats: DecodeStats) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.generation.chat else "text_completion",
                "created": self.created, "model": self.generation.served.id, "choices": [],
                "usage": self.usage(stats)}

    # --- shared -------------------------------------------------------------------------------

    def usage(self, stats: DecodeStats) -> dict[str, Any]:
        prompt = len(self.generation.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": stats.tokens, "total_tokens": prompt + stats.tokens,
                "forwards": stats.forwards, "tokens_per_forward": round(stats.tpf, 4),
                "decode_seconds": round(stats.seconds, 6), "tokens_per_second": round(stats.tps, 3)}

    def finish_reason(self, text: str, result: Any) -> str:
        """``stop`` when the response ended at an end id or a stop string, else ``length``."""
        ended = bool(result.tokens) and result.tokens[-1] in self.state.loaded.stop_token_ids
        full = self.state.loaded.tokenizer.decode(result.tokens, skip_special_tokens=True)
        return "stop" if ended or len(text) < len(full) else "length"

    def mark_first_byte(self) -> None:
        if self.first_byte is None:
            self.first_byte = time.perf_counter()
            self.state.metrics.ttfb.observe(self.first_byte - self.received)

    def done(self, outcome: str) -> None:
        self.state.metrics.requests.labels(outcome).inc()
        self.state.metrics.latency.observe(time.perf_counter() - self.received)

    def cancel(self) -> None:
        self.state.scheduler.cancel(self.job)
        self.state.metrics.requests.labels("cancelled").inc()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


__all__ = ["Run", "ServerState", "check_address", "create_app", "run_server"]
