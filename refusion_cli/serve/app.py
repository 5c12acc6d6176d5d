"""The HTTP side of ``refusion serve``: routes that parse and validate a request, hand it to the
:class:`~refusion_cli.serve.engine.Scheduler`, and drain the job's events into an OpenAI response.

No model code runs here and no HTTP object reaches the engine: a job's events travel from the
scheduler thread to the route through an ``asyncio.Queue`` (``call_soon_threadsafe``), so a slow
client never holds the scheduler up. A streamed response whose client goes away cancels its job (its
row leaves before the next model call); so does a non-streamed one, checked twice a second.

A tokenizer is called from one thread only: the tokenizer thread (off the event loop) parses (tokenization,
the chat template), makes the streamed deltas and the final text; the stop rules, which the scheduler thread
runs, read a copy of their own (``ServerState.stop_tokenizers``). A streamed answer begins (status and
headers) with the first decoder step, so until then a balancer may still send the request to another replica.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or not), ``POST /tokenize``
(vLLM's), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` and the web view at ``/``. With an API key,
the ``/v1`` routes and ``/tokenize`` need ``Authorization: Bearer KEY`` (compared in constant time). Every
refusal is an OpenAI error object with a 4xx status; a 500 names a request id that the log holds with the
cause, never the exception's text. When the scheduler dies, ``/health`` answers 503 with the reason, every
open request gets an error, and :class:`Lifeline` stops the server so that the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from refusion_cli.decoding.engine import Request as EngineRequest
from refusion_cli.decoding.rows import Commit
from refusion_cli.models.loading import LoadedModel
from refusion_cli.serve.engine import Commits, Dead, Draining, Event, Failed, Finished, Job, QueueFull, Scheduler
from refusion_cli.serve.metrics import ServeMetrics
from refusion_cli.serve.protocol import (ApiError, Generation, ServedModel, error_body, parse_generation,
                                         parse_tokenize)
from refusion_cli.serve.text import PrefixText, StopWatch, TextRules, answer_text

log = logging.getLogger("refusion.serve")
RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.5
T = TypeVar("T")


@dataclass
class ServerState:
    served: dict[str, ServedModel]  # by model id
    schedulers: dict[str, Scheduler]  # by checkpoint, as the user named it: each owns its model
    metrics: ServeMetrics
    api_key: str | None = None
    seed: int = 0
    shutdown_timeout: float = 30.0
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="refusion-tokenizer"))
    stop_tokenizers: dict[str, Any] = field(init=False)  # by checkpoint: the one its scheduler's stop rules call

    def __post_init__(self) -> None:
        for entry in self.served.values():
            self.metrics.serve(entry.checkpoint, entry.id)
        self.stop_tokenizers = {name: copy.deepcopy(s.loaded.tokenizer) for name, s in self.schedulers.items()}

    @property
    def models(self) -> dict[str, LoadedModel]:
        """The loaded models by checkpoint."""
        return {name: scheduler.loaded for name, scheduler in self.schedulers.items()}

    @property
    def failure(self) -> str | None:
        """Why a scheduler died (None: all run)."""
        return next((s.failure for s in self.schedulers.values() if s.failure is not None), None)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for scheduler in state.schedulers.values():
            scheduler.start()
        yield
        finished = all(await asyncio.gather(*(asyncio.to_thread(scheduler.drain, state.shutdown_timeout)
                                              for scheduler in state.schedulers.values())))
        log.info("shut down: %s", "every request finished" if finished else "unfinished requests ended with an error")
        state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="refusion serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 429 else {}
        if exc.request_id is not None:
            headers["X-Request-Id"] = exc.request_id
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        request_id = "req-" + uuid.uuid4().hex[:24]
        log.error("internal error, request id %s", request_id, exc_info=exc)
        return JSONResponse(error_body(f"internal error (request id {request_id}; the server log has the cause)",
                                       "server_error", code="internal_error"), status_code=500,
                            headers={"X-Request-Id": request_id})

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("refusion_cli.serve").joinpath("page.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while every scheduler runs; 503 with the reason once one died (the process is about to exit)."""
        checkpoints = {model_id: entry.checkpoint for model_id, entry in state.served.items()}
        if state.failure is not None:
            return JSONResponse({"status": "error", "reason": state.failure, "checkpoints": checkpoints},
                                status_code=503)
        schedulers = state.schedulers.values()
        return JSONResponse({"status": "ok", "models": list(state.served), "checkpoints": checkpoints,
                             "running_rows": sum(s.rows for s in schedulers),
                             "queue_depth": sum(s.depth for s in schedulers)})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, state.api_key)
        return {"object": "list", "data": [model_card(entry) for entry in state.served.values()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, state, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, state, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``{prompt}`` or ``{messages}`` (the chat template), ``add_special_tokens``."""
        authorize(request, state.api_key)
        body = await read_json(request)
        tokens, loaded = await off_loop(state, parse_tokenize, body, served=state.served, models=state.models)
        limit = getattr(loaded.model.config, "max_position_embeddings", None)
        return {"count": len(tokens), "max_model_len": limit, "tokens": tokens, "token_strs": None}

    return app


def authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    if not hmac.compare_digest(given, api_key.encode()) or scheme.lower() != "bearer":
        raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'", code="invalid_api_key",
                       kind="authentication_error")


def model_card(entry: ServedModel) -> dict[str, Any]:
    return {"id": entry.id, "object": "model", "created": 0, "owned_by": "refusion",
            "decoder": entry.decoder, "checkpoint": entry.checkpoint}


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


async def off_loop(state: ServerState, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function`` on the server's tokenizer thread, the one thread that calls the models' tokenizers."""
    return await asyncio.get_running_loop().run_in_executor(state.executor, functools.partial(function, *args,
                                                                                              **kwargs))


async def generate(request: Request, state: ServerState, *, chat: bool) -> Response:
    received = time.perf_counter()
    authorize(request, state.api_key)
    body = await read_json(request)
    generation = await off_loop(state, parse_generation, body, chat=chat, served=state.served, models=state.models,
                                default_seed=state.seed)
    run = Run(generation, state, received)
    run.submit()
    headers = {"X-Request-Id": run.id}
    if generation.stream:
        first = await run.next_event(request)  # the answer begins with the first step: until then a balancer
        if isinstance(first[1], Failed):        # may still send the request elsewhere
            raise run.failure(first[1])
        return StreamingResponse(run.stream(first), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await run.answer(request), headers=headers)


@dataclass
class Choice:
    """One row of a request: a prompt, ``n`` times over (seeds seed + i)."""

    index: int
    prompt_ids: list[int]
    job: Job
    watch: StopWatch | None  # the job's stop rule
    text: PrefixText  # the streamed text
    request: EngineRequest | None = None  # the engine's handle of the job, once submitted
    committed: int = 0  # tokens committed so far (streamed)
    chunks: int = 0  # stream chunks that carried commits
    role_sent: bool = False
    outcome: Finished | None = None
    tokens: list[int] = field(default_factory=list)  # the response's tokens once finished
    finish_reason: str | None = None

    def settle(self, outcome: Finished, rules: TextRules) -> None:
        """The response's tokens and why it ended: the stop rule's cut, an end id, or the budget."""
        self.outcome = outcome
        self.tokens = outcome.result.tokens
        if self.watch is not None and self.watch.reason is not None:
            self.tokens = self.tokens[: self.watch.kept]
            self.finish_reason = self.watch.reason
        else:
            ended = bool(self.tokens) and rules.ends(self.tokens[-1], len(self.tokens) - 1)
            self.finish_reason = "stop" if ended else "length"

    @property
    def completion_tokens(self) -> int:
        if self.outcome is None:
            return self.committed
        cut = self.watch is not None and self.watch.reason is not None
        return len(self.tokens) if cut else self.outcome.result.stats.tokens


class Run:
    """One request's jobs (a choice each) and the events they send back."""

    def __init__(self, generation: Generation, state: ServerState, received: float):
        self.generation = generation
        self.state = state
        self.scheduler = state.schedulers[generation.served.checkpoint]
        self.tokenizer = self.scheduler.loaded.tokenizer
        self.labels = (generation.served.checkpoint, generation.served.id)  # the metrics' model and decoder
        self.received = received
        self.id = ("chatcmpl-" if generation.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        rules = generation.rules
        checkpoint = generation.served.checkpoint
        eos = () if rules.ignore_eos or rules.min_tokens else None  # (): the stop rule ends at the end ids

        def sink_of(index: int) -> Callable[[Event], None]:
            def sink(event: Event) -> None:
                try:
                    loop.call_soon_threadsafe(self.events.put_nowait, (index, event))
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass
            return sink

        self.choices: dict[int, Choice] = {}
        for index, prompt_ids, seed in generation.choices:
            watch = StopWatch(state.stop_tokenizers[checkpoint], rules) if rules.needs_rule else None
            job = Job(generation.served.decoder, prompt_ids, generation.config, sink_of(index), seed=seed,
                      variant=generation.served.variant, steps=generation.stream, eos_token_ids=eos, stop=watch)
            self.choices[index] = Choice(index, prompt_ids, job, watch, PrefixText(self.tokenizer, rules))
        self.first_byte: float | None = None

    def submit(self) -> None:
        try:
            for choice in self.choices.values():
                choice.request = self.scheduler.submit(choice.job)
        except (QueueFull, Draining, Dead) as refusal:
            self.cancel_choices()
            self.state.metrics.requests.labels("error", *self.labels).inc()
            if isinstance(refusal, QueueFull):
                raise ApiError(429, f"the queue is full ({self.scheduler.max_queue} requests wait); retry "
                                    "later", code="queue_full", kind="rate_limit_error") from None
            if isinstance(refusal, Dead):
                raise ApiError(503, f"{refusal}; the server is about to exit", kind="server_error") from None
            raise ApiError(503, "the server is shutting down", kind="server_error") from None

    async def next_event(self, request: Request) -> tuple[int, Event]:
        """The next event of any choice; a client gone meanwhile cancels the request (499)."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    raise ApiError(499, "the client closed the request") from None

    def failure(self, event: Failed) -> ApiError:
        """The error a failed choice makes of the request (the other choices are cancelled): 503 when the
        scheduler died (a balancer may retry elsewhere), else 500; the cause is in the log, by request id."""
        self.done("error")
        self.cancel_choices()
        if self.scheduler.failure is not None:
            return ApiError(503, f"{event.message} (request id {self.id})", kind="server_error",
                            code="scheduler_stopped", request_id=self.id)
        if event.error is not None:
            log.error("request %s failed: %s", self.id, event.message, exc_info=event.error)
            return ApiError(500, f"internal error while decoding (request id {self.id}; the server log has the "
                                 "cause)", kind="server_error", code="internal_error", request_id=self.id)
        log.error("request %s failed: %s", self.id, event.message)
        return ApiError(500, f"{event.message} (request id {self.id})", kind="server_error", request_id=self.id)

    # --- the whole answer ---------------------------------------------------------------------

    async def answer(self, request: Request) -> dict[str, Any]:
        rules = self.generation.rules
        waiting = set(self.choices)
        while waiting:
            index, event = await self.next_event(request)
            if isinstance(event, Failed):
                raise self.failure(event)
            if isinstance(event, Finished):
                self.choices[index].settle(event, rules)
                waiting.discard(index)
        self.mark_first_byte()
        self.done("ok")
        tokenizer = self.tokenizer
        texts = await off_loop(self.state, lambda: [answer_text(tokenizer, choice.tokens, rules)
                                                    for choice in self.choices.values()])
        choices = []
        for choice, text in zip(self.choices.values(), texts):
            body: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason, "logprobs": None}
            if self.generation.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            choices.append(body)
        return {"id": self.id, "object": "chat.completion" if self.generation.chat else "text_completion",
                "created": self.created, "model": self.generation.served.id, "choices": choices,
                "usage": self.usage()}

    # --- the stream ---------------------------------------------------------------------------

    async def stream(self, first: tuple[int, Event]) -> AsyncIterator[str]:
        finished = False
        pending = [first]
        open_choices = set(self.choices)
        try:
            while open_choices:
                if not pending:
                    pending.append(await self.events.get())
                while not self.events.empty():  # the steps queued for a slow client go as one chunk a choice
                    pending.append(self.events.get_nowait())
                batch, pending = pending, []
                gathered: dict[int, list[Commit]] = {}
                for index, event in batch:
                    if isinstance(event, Commits):
                        gathered.setdefault(index, []).extend(event.commits)
                        continue
                    if index in gathered:
                        yield sse(await self.commits_chunk(self.choices[index], gathered.pop(index)))
                    if isinstance(event, Failed):
                        self.failure(event)
                        finished = True
                        yield sse(error_body(self.failure_message(event), "server_error"))
                        yield "data: [DONE]\n\n"
                        return
                    if isinstance(event, Finished):
                        for chunk in await self.final_chunks(self.choices[index], event):
                            yield sse(chunk)
                        open_choices.discard(index)
                for index, commits in gathered.items():
                    yield sse(await self.commits_chunk(self.choices[index], commits))
                self.mark_first_byte()
            if self.generation.include_usage:
                yield sse(self.usage_chunk())
            finished = True
            self.done("ok")
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (the stream was closed early)
                self.cancel()

    def failure_message(self, event: Failed) -> str:
        if self.scheduler.failure is not None or event.error is None:
            return f"{event.message} (request id {self.id})"
        return f"internal error while decoding (request id {self.id}; the server log has the cause)"

    async def commits_chunk(self, choice: Choice, commits: list[Commit]) -> dict[str, Any]:
        """The chunk of a step's commits (their text made on the tokenizer thread)."""
        limit = self.generation.rules.max_tokens
        commits = [c for c in commits if limit is None or c.offset < limit]  # a slot past max_tokens is cut
        tokenizer = self.tokenizer
        delta, texts = await off_loop(self.state, lambda: (choice.text.add(commits), [
            tokenizer.decode([c.token], skip_special_tokens=False) for c in commits]))
        choice.committed += len(commits)
        choice.chunks += 1
        self.state.metrics.stream_chunks.labels(*self.labels).inc()
        chunk = self.chunk(choice, delta, None)
        chunk["commits"] = [{"offset": c.offset, "token": c.token, "kind": c.kind, "text": text}
                            for c, text in zip(commits, texts)]
        return chunk

    async def final_chunks(self, choice: Choice, event: Finished) -> list[dict[str, Any]]:
        """The chunk with the rest of the answer and its ``finish_reason``."""
        rules = self.generation.rules
        choice.settle(event, rules)
        answer = await off_loop(self.state, answer_text, self.tokenizer, choice.tokens, rules)
        rest = choice.text.finish(answer)
        if choice.text.sent != answer:
            log.warning("request %s: the streamed text is not the answer's", self.id)
        return [self.chunk(choice, rest, choice.finish_reason)]

    def chunk(self, choice: Choice, delta: str, finish: str | None) -> dict[str, Any]:
        chat = self.generation.chat
        body: dict[str, Any] = {"index": choice.index, "finish_reason": finish, "logprobs": None}
        if chat:
            body["delta"] = ({} if choice.role_sent else {"role": "assistant"}) | (
                {"content": delta} if delta or finish is None else {})
            choice.role_sent = True
        else:
            body["text"] = delta
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                                 "created": self.created, "model": self.generation.served.id, "choices": [body]}
        if self.generation.continuous_usage:
            prompt = len(choice.prompt_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": choice.completion_tokens,
                              "total_tokens": prompt + choice.completion_tokens}
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.generation.chat else "text_completion",
                "created": self.created, "model": self.generation.served.id, "choices": [], "usage": self.usage()}

    # --- shared -------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        """OpenAI's counts (a prompt counts once, whatever ``n``) and the decoders' figures: model calls
        (``forwards``, summed over the choices), tokens committed per call and, streamed, per chunk."""
        choices = list(self.choices.values())
        prompt = sum(len(prompt) for prompt in self.generation.prompts)
        completion = sum(choice.completion_tokens for choice in choices)
        forwards = sum(choice.outcome.result.stats.forwards for choice in choices if choice.outcome is not None)
        seconds = max((choice.outcome.result.stats.seconds for choice in choices if choice.outcome is not None),
                      default=0.0)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "forwards": forwards, "tokens_per_forward": round(completion / forwards, 4) if forwards else 0.0,
            "decode_seconds": round(seconds, 6), "tokens_per_second": round(completion / seconds, 3) if seconds else 0.0}
        if self.generation.stream:
            chunks = sum(choice.chunks for choice in choices)
            usage["stream_chunks"] = chunks
            usage["tokens_per_chunk"] = round(sum(choice.committed for choice in choices) / chunks, 4) if chunks else 0.0
        return usage

    def mark_first_byte(self) -> None:
        if self.first_byte is None:
            self.first_byte = time.perf_counter()
            self.state.metrics.ttfb.labels(*self.labels).observe(self.first_byte - self.received)

    def done(self, outcome: str) -> None:
        metrics = self.state.metrics
        metrics.requests.labels(outcome, *self.labels).inc()
        metrics.latency.labels(*self.labels).observe(time.perf_counter() - self.received)
        if outcome == "ok":
            choices = self.choices.values()
            metrics.tokens.labels(*self.labels).inc(sum(choice.completion_tokens for choice in choices))
            metrics.forwards.labels(*self.labels).inc(sum(choice.outcome.result.stats.forwards for choice in choices
                                                          if choice.outcome is not None))

    def cancel(self) -> None:
        self.cancel_choices()
        self.state.metrics.requests.labels("cancelled", *self.labels).inc()

    def cancel_choices(self) -> None:
        for choice in self.choices.values():
            if choice.request is not None:
                self.scheduler.cancel(choice.request)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


__all__ = ["Run", "ServerState", "create_app"]
