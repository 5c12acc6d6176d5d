"""The serving scheduler: one thread owns the model and steps the one decoding engine
(:class:`refusion_cli.decoding.engine.Engine`), which admits and retires rows between two model calls
(step-level continuous batching) under a row cap and a memory budget.

Contract. :meth:`Scheduler.submit` takes a :class:`Job` (prompt ids, a validated decoder config, a seed
and a ``sink``) from any thread, hands the engine its :class:`~refusion_cli.decoding.engine.Request` and
returns that request at once (the handle :meth:`Scheduler.cancel` takes); it raises :class:`QueueFull` when
``max_queue`` requests already wait, :class:`Draining` once :meth:`Scheduler.drain` began and :class:`Dead`
once the scheduler thread has died. The engine alone keeps the open requests (its ``waiting`` queue and
``running`` rows): ``Engine.submit`` appends to a deque, which is safe from any thread, and only the
scheduler thread steps the engine. Sinks get :class:`Commits` (what each decoder step committed; only when the job asks
for ``steps``), then :class:`Finished` or :class:`Failed`; a sink must not block (the HTTP side puts
events on a queue) and its time is kept out of the row's latency.

A job's ``stop`` rule ends its row at the step where its committed prefix holds a stop (the HTTP side's
stop strings, ``min_tokens``): the row leaves the batch then, so the compute is saved, not only the text
cut; ``eos_token_ids`` replaces the model's end ids for the job (``()``: none, ``ignore_eos``).

Faults: an exception in one row's program fails that job only; one in a shared model call fails the rows
of that call (a memory error requeues them instead: see the engine). An exception anywhere else in the
scheduler thread is fatal: :attr:`Scheduler.failure` holds its reason, every waiting and running job
gets :class:`Failed`, later submits raise :class:`Dead`, and ``on_death(reason)`` is called so that the
process can exit and its supervisor restart it.

Nothing here knows of HTTP or text: token ids in, token ids and counters out.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refusion_cli.decoding.engine import Engine, Failed, Finished, Outcome, Request, StopRule
from refusion_cli.decoding.registry import row_options
from refusion_cli.decoding.rows import Commit, commits
from refusion_cli.decoding.stats import EosIds
from refusion_cli.decoding.variants import PAPER, Variant
from refusion_cli.models.loading import LoadedModel

log = logging.getLogger("refusion.serve")


class QueueFull(Exception):
    """``max_queue`` jobs already wait."""


class Draining(Exception):
    """The server is shutting down and takes no new job."""


class Dead(Exception):
    """The scheduler thread died; the process is about to exit."""


@dataclass(frozen=True)
class Commits:
    commits: list[Commit]


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
    eos_token_ids: EosIds | None = None  # None: the model's end ids; (): none (the response runs to its budget)
    stop: StopRule | None = None  # ends the row early (engine.StopRule); its Finished is ``stopped``


class EngineStats:
    """What a scheduler reports as it runs, under its model's name (the metrics read it); every hook is a no-op
    here."""

    def queued(self, model: str, depth: int) -> None: ...

    def running(self, model: str, rows: int) -> None: ...

    def model_call(self, model: str, rows: int) -> None: ...

    def oom_requeue(self, model: str) -> None: ...


class Scheduler:
    def __init__(self, loaded: LoadedModel, name: str, *, max_batch: int = 16, max_queue: int = 256,
                 max_memory: int | None = None, stats: EngineStats | None = None,
                 on_death: Callable[[str], None] | None = None):
        """The scheduler of ``loaded`` (its checkpoint named ``name``). ``max_batch``: the most rows at once;
        ``max_memory`` (bytes): admit rows while the memory model's bytes fit it (None: rows are bounded by
        ``max_batch`` only)."""
        self.loaded = loaded
        self.name = name
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.stats = stats or EngineStats()
        self.on_death = on_death
        self.device = next(loaded.model.parameters()).device
        self.engine = Engine(loaded.model, max_rows=max_batch, max_memory=max_memory)
        self.engine.on_call = functools.partial(self.stats.model_call, name)
        self.engine.on_requeue = functools.partial(self.stats.oom_requeue, name)
        self.failure: str | None = None  # why the scheduler thread died (None: alive)
        self._wake = threading.Condition()
        self._draining = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="refusion-scheduler", daemon=True)

    # --- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Request:
        """Hand ``job`` to the engine; its request is the handle :meth:`cancel` takes."""
        request = self._request(job)
        with self._wake:
            if self.failure is not None:
                raise Dead(self.failure)
            if self._draining:
                raise Draining()
            if self.depth >= self.max_queue:
                raise QueueFull()
            self.engine.submit(request)
            self.stats.queued(self.name, self.depth)
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Drop ``request``: waiting, it never starts; running, its row leaves before the next model call."""
        self.engine.cancel(request)
        with self._wake:
            self._wake.notify()

    @property
    def depth(self) -> int:
        return len(self.engine.waiting)

    @property
    def rows(self) -> int:
        return len(self.engine.running)

    @property
    def alive(self) -> bool:
        return self.failure is None

    def drain(self, timeout: float) -> bool:
        """Take no new job, let the queued and running ones finish within ``timeout`` seconds, then fail
        whatever is left and stop; True when everything finished in time."""
        with self._wake:
            self._draining = True
            self._wake.notify()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.failure is None and (self.depth or self.rows):
            time.sleep(0.02)
        finished = not (self.depth or self.rows)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        return finished

    # --- the scheduler thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as error:  # noqa: BLE001 - anything that escapes the guarded calls is fatal
            self._die(error)
            return
        self._fail_all("the server shut down before this request finished")

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self.engine.busy or self._stopped):
                    self._wake.wait()
                if self._stopped:
                    return
            self.engine.step()
            self.stats.queued(self.name, self.depth)
            self.stats.running(self.name, self.rows)

    def _request(self, job: Job) -> Request:
        """The job as an engine request (its prompt on the device, its generator seeded)."""
        sink = job.sink
        eos = self.loaded.stop_token_ids if job.eos_token_ids is None else job.eos_token_ids
        request = Request(
            job.decoder, torch.tensor(job.prompt_ids, dtype=torch.long, device=self.device), job.config,
            row_options(job.decoder, self.loaded.mask_token_id, eos, job.variant),
            done=lambda outcome: self._done(request, job, outcome),
            generator=torch.Generator(device=self.device).manual_seed(job.seed),
            on_step=(lambda record: sink(Commits(commits(record)))) if job.steps else None, stop=job.stop)
        return request

    def _done(self, request: Request, job: Job, outcome: Outcome) -> None:
        if isinstance(outcome, Failed) and outcome.error is not None:
            log.error("request %d failed: %s", request.id, outcome.message, exc_info=outcome.error)
        job.sink(outcome)

    def _fail_all(self, message: str) -> None:
        """Fail every request the engine holds (no submit comes in meanwhile: see :meth:`submit`)."""
        with self._wake:
            engine = self.engine
            requests = [*engine.waiting, *(row.request for row in engine.running.values())]
            engine.waiting.clear()
            engine.running.clear()
        for request in requests:
            if not request.cancelled:
                request.done(Failed(message))
        self.stats.running(self.name, 0)
        self.stats.queued(self.name, 0)

    def _die(self, error: BaseException) -> None:
        reason = f"the scheduler stopped: {type(error).__name__}"
        log.critical("%s", reason, exc_info=error)
        with self._wake:
            self.failure = reason
        self._fail_all("the server's scheduler stopped; this request was not answered")
        if self.on_death is not None:
            self.on_death(reason)


__all__ = ["Commits", "Dead", "Draining", "EngineStats", "Event", "Failed", "Finished", "Job", "QueueFull",
           "Scheduler"]
