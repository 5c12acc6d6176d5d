"""The serving engine: one scheduler thread owns the model and decodes every request as a row of a
padded batch, admitting and retiring rows between two model calls (step-level continuous batching).

Contract. :meth:`Scheduler.submit` takes a :class:`Job` (prompt ids, a validated decoder config, a seed
and a ``sink``) from any thread and returns at once; it raises :class:`QueueFull` when ``max_queue`` jobs
already wait and :class:`Draining` once :meth:`Scheduler.drain` began. The scheduler thread:

1. admits waiting jobs, oldest first, while fewer than ``max_batch`` rows run: each opens a row
   (its registry entry's ``open_row``) in the shared-calls object of its kind (``Lanes`` for ReFusion and AR,
   ``CanvasCalls`` for the masked-diffusion decoders) and runs up to its first feed;
2. drops the rows whose job was cancelled (a client that went away);
3. makes one padded model call per kind of the running rows' feeds and sends each row its logits;
   a row whose program returned is retired and its job's sink gets :class:`Finished`.

A row decodes exactly the program ``run_decoder`` runs for that prompt alone, with its own
``torch.Generator`` seeded with the job's seed; a batched call differs from a batch of one at most by
float rounding (docs/serve.md). Sinks get :class:`Commits` (what each decoder step committed),
(only when the job asks for ``steps``), then :class:`Finished` or :class:`Failed`; a sink must not block (the HTTP side puts events on a queue)
and its time is kept out of the row's latency. An exception in one row's program fails that job
only; one in a shared model call fails the rows of that call, and the next call starts afresh.

Nothing here knows of HTTP or text: token ids in, token ids and counters out.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from refusion_cli.decoding.cache import SharedCalls
from refusion_cli.decoding.registry import calls_kind, decoder_spec, row_options
from refusion_cli.decoding.rows import Commit, RowProgram, commits, shared_calls
from refusion_cli.decoding.stats import BatchClock, DecodeResult
from refusion_cli.decoding.variants import PAPER, Variant
from refusion_cli.models.loading import LoadedModel

log = logging.getLogger("refusion.serve")


class QueueFull(Exception):
    """``max_queue`` jobs already wait."""


class Draining(Exception):
    """The server is shutting down and takes no new job."""


@dataclass(frozen=True)
class Commits:
    commits: list[Commit]


@dataclass(frozen=True)
class Finished:
    result: DecodeResult  # tokens in position order, cut after the first EOS; stats.seconds: the row's latency


@dataclass(frozen=True)
class Failed:
    message: str


Event = Commits | Finished | Failed


@dataclass
class Job:
    """One request's decode: what the engine needs and where its events go."""

    decoder: str
    prompt_ids: list[int]
    config: Any  # the decoder's validated config
    sink: Callable[[Event], None]  # called from the scheduler thread; must not block
    seed: int = 0
    variant: Variant = PAPER
    steps: bool = True  # send Commits events (a streamed response); False: Finished or Failed only
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=itertools.count().__next__)


@dataclass
class _Row:
    job: Job
    program: RowProgram
    calls: SharedCalls
    clock: BatchClock
    feed: Any = None


class EngineStats:
    """What the scheduler reports as it runs (the metrics read it); every hook is a no-op here."""

    def queued(self, depth: int) -> None: ...

    def running(self, rows: int) -> None: ...

    def model_call(self, rows: int) -> None: ...

    def finished(self, result: DecodeResult) -> None: ...


class Scheduler:
    def __init__(self, loaded: LoadedModel, *, max_batch: int = 16, max_queue: int = 256,
                 stats: EngineStats | None = None):
        self.loaded = loaded
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.stats = stats or EngineStats()
        self.device = next(loaded.model.parameters()).device
        self._waiting: deque[Job] = deque()
        self._running: dict[int, _Row] = {}
        self._calls: dict[tuple[str, bool], SharedCalls] = {}
        self._wake = threading.Condition()
        self._draining = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="refusion-scheduler", daemon=True)

    # --- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._draining:
                raise Draining()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self.stats.queued(len(self._waiting))
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Drop ``job``: waiting, it never starts; running, its row leaves before the next model call."""
        job.cancelled.set()
        with self._wake:
            self._wake.notify()

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def rows(self) -> int:
        return len(self._running)

    def drain(self, timeout: float) -> bool:
        """Take no new job, let the queued and running ones finish within ``timeout`` seconds, then fail
        whatever is left and stop; True when everything finished in time."""
        with self._wake:
            self._draining = True
            self._wake.notify()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self._waiting or self._running):
            time.sleep(0.02)
        finished = not (self._waiting or self._running)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        return finished

    # --- the scheduler thread -------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._waiting or self._running or self._stopped):
                        self._wake.wait()
                    if self._stopped:
                        break
                    admitted = self._admit()
                for row in admitted:
                    self._advance(row, None)
                self._drop_cancelled()
                for kind, calls in list(self._calls.items()):
                    rows = {index: row for index, row in self._running.items() if row.calls is calls}
                    if rows:
                        self._call(kind, calls, rows)
        for row in list(self._running.values()):
            self._retire(row, Failed("the server shut down before this request finished"))
        for job in self._waiting:
            job.sink(Failed("the server shut down before this request started"))
        self._waiting.clear()
        self.stats.running(0)
        self.stats.queued(0)

    def _admit(self) -> list[_Row]:
        """Open rows for waiting jobs while there is room (called under the lock)."""
        admitted = []
        while self._waiting and len(self._running) + len(admitted) < self.max_batch:
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                continue
            calls = self._calls_for(job)
            clock = BatchClock(self.device)
            sink = job.sink

            def on_step(record: Any, sink: Callable[[Event], None] = sink) -> None:
                sink(Commits(commits(record)))

            try:
                prompt = torch.tensor(job.prompt_ids, dtype=torch.long, device=self.device)
                generator = torch.Generator(device=self.device).manual_seed(job.seed)
                options = row_options(job.decoder, self.loaded.mask_token_id, self.loaded.stop_token_ids, job.variant)
                program = decoder_spec(job.decoder).open_row(calls, job.id, prompt, job.config, options, generator,
                                                             on_step if job.steps else None, clock)
            except Exception as exc:  # a bad row fails its request only
                log.exception("request %d could not start", job.id)
                job.sink(Failed(f"the decode could not start: {exc}"))
                continue
            row = _Row(job, program, calls, clock)
            self._running[job.id] = row
            admitted.append(row)
        self.stats.queued(len(self._waiting))
        self.stats.running(len(self._running))
        return admitted

    def _calls_for(self, job: Job) -> SharedCalls:
        kind = calls_kind(job.decoder, job.variant)
        if kind not in self._calls:
            self._calls[kind] = shared_calls(kind, self.loaded.model)
        return self._calls[kind]

    def _advance(self, row: _Row, reply: Any) -> None:
        """Send ``reply`` to the row's program (None: start it) and keep its next feed, or retire it."""
        try:
            row.feed = next(row.program) if reply is None else row.program.send(reply)
        except StopIteration as stop:
            result: DecodeResult = stop.value
            result.stats.seconds = row.clock.latency()
            self._retire(row, Finished(result))
        except Exception as exc:  # this request's decode failed; the others go on
            log.exception("request %d failed", row.job.id)
            self._retire(row, Failed(f"the decode failed: {exc}"))

    def _drop_cancelled(self) -> None:
        for row in [row for row in self._running.values() if row.job.cancelled.is_set()]:
            row.program.close()
            self._retire(row, None)

    def _call(self, kind: tuple[str, bool], calls: SharedCalls, rows: dict[int, _Row]) -> None:
        """One padded model call of every row's feed, each row sent its reply."""
        try:
            replies = calls.forward({index: row.feed for index, row in rows.items()})
        except Exception as exc:  # the shared call failed: its rows fail, the next call starts afresh
            log.exception("a model call of %d rows failed", len(rows))
            del self._calls[kind]
            for row in rows.values():
                self._running.pop(row.job.id, None)
                row.program.close()
                row.job.sink(Failed(f"the model call failed: {exc}"))
            self.stats.running(len(self._running))
            return
        self.stats.model_call(len(rows))
        for index, row in rows.items():
            self._advance(row, replies[index])

    def _retire(self, row: _Row, event: Event | None) -> None:
        self._running.pop(row.job.id, None)
        self.stats.running(len(self._running))
        row.calls.close(row.job.id)
        if isinstance(event, Finished):
            self.stats.finished(event.result)
        if event is not None:
            row.job.sink(event)


__all__ = ["Commits", "Draining", "EngineStats", "Event", "Failed", "Finished", "Job", "QueueFull", "Scheduler"]
