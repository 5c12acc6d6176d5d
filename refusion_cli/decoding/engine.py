"""The one decoding engine: every command decodes through it (eval, bench, chat, the lm-eval adapters,
serve), one request or ten thousand.

Contract. :meth:`Engine.submit` takes a :class:`Request` (prompt ids, decoder, config, generator,
ReFusion's variant) and returns at once; :meth:`Engine.step` makes one scheduling round:

1. admit waiting requests, oldest first, while the rows fit: at most ``max_rows`` rows, and with a
   memory budget (``max_memory``, else none) the rows' bytes by ``decoding.memory``'s model within it;
   each opens a row (its registry entry's ``open_row``) in the shared-calls object of its kind
   (``cache.CausalRunner`` for ReFusion and AR, ``mdm.CanvasRunner`` for the masked-diffusion decoders) and
   runs up to its first feed;
2. drop the rows whose request was cancelled;
3. make one model call per kind for the running rows' feeds, send each row its logits, and retire the
   rows whose program returned (or whose request's ``stop`` ended them): their places go to waiting
   requests at the next round (continuous batching).

A model call that runs out of memory puts its rows back at the front of the queue (their programs
restart, their generators from the state they were admitted with, their step records already
delivered are not repeated), lowers the row cap to half of that call's rows (rounded up) and goes on: no request
fails for a memory error that fewer rows avoid (``oom_requeues`` counts these events). The cap holds while the
requests of the calls that failed are served; once the last of them has left, it is ``max_rows`` again
(``cap_restores``), so one long prompt does not halve a server's batch for good. Any other error
in a shared call fails the rows of that call; one in a row's program fails that request only.

A row decodes exactly the program the decoder runs for that prompt alone; a shared call differs from
a call of one row at most by float rounding, so a decision within that rounding of a tie can go the
other way (docs/counting.md).

:func:`run_decoder` is "submit all, step until done". Nothing here knows of text, HTTP or threads:
token ids in, token ids and counters out.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from refusion_cli.decoding.batching import Generators, Prompt, Prompts, batch_prompts, row_callback, row_generators
from refusion_cli.decoding.cache import ModelRunner
from refusion_cli.decoding.memory import BatchChoice, ModelSize, fitting_batch, is_out_of_memory, memory_budget, reserve
from refusion_cli.decoding.readback import Batched, Readback, read_all
from refusion_cli.decoding.registry import calls_kind, decoder_spec, row_memory_bytes, row_options
from refusion_cli.decoding.rows import RowOptions, RowProgram, commits, response_budget, shared_calls
from refusion_cli.decoding.stats import CallbackTime, DecodeResult, DecodeStats, EosIds, RowClock
from refusion_cli.errors import UserError

log = logging.getLogger("refusion.engine")


# ---------------------------------------------------------------------------------------------
# requests and what the engine tells of them


@dataclass(frozen=True)
class Finished:
    result: DecodeResult  # tokens in position order, cut after the first EOS; stats.seconds: admission to end
    stopped: bool = False  # ended by the request's ``stop`` (the tokens are what it kept)


@dataclass(frozen=True)
class Failed:
    message: str
    error: BaseException | None = None


Outcome = Finished | Failed


# ``stop(prefix)``: given the response's committed prefix (the tokens committed from offset 0 on, without a gap),
# the number of its tokens to keep if the decode should end now, else None
StopRule = Callable[[list[int]], "int | None"]


@dataclass(eq=False)
class Request:
    """One prompt's decode: what the engine needs, and where its outcome goes."""

    decoder: str
    prompt: torch.Tensor  # [P] on the model's device
    config: Any  # the decoder's validated config
    options: RowOptions  # mask and EOS ids, ReFusion's variant, Dream's shift
    done: Callable[[Outcome], None]  # called once, from the thread that steps the engine
    generator: torch.Generator | None = None
    kv_reuse: bool = True  # ReFusion's recompute ablation when False
    on_step: Callable[[Any], None] | None = None  # the decoder's step records, as they are committed
    stop: StopRule | None = None
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False
    reported: int = 0  # step records delivered (a row restarted after a memory error does not repeat them)


@dataclass(eq=False)
class _Row:
    request: Request
    program: RowProgram
    calls: ModelRunner
    clock: RowClock
    nbytes: int  # what the memory model says the row holds at its largest call
    generator_state: torch.Tensor | None
    feed: Any = None
    forwards: int = 0  # model calls the row took part in
    records: int = 0  # step records of this run of the row
    prefix: list[int] = field(default_factory=list)  # the committed prefix (with a stop rule)
    committed: dict[int, int] = field(default_factory=dict)  # committed tokens right of a gap, by offset
    stop_at: int | None = None  # tokens kept when the stop rule ended the row


@dataclass
class EngineCounts:
    """What the engine did: the most rows of a call, and the memory errors it handled."""

    peak_rows: int = 0  # the most rows of one call
    steps: int = 0  # scheduling rounds (Engine.step)
    readbacks: int = 0  # transfers of the rows' values to the host (at most one a round for each kind of wait)
    oom_requeues: int = 0  # model calls that ran out of memory and put their rows back in the queue
    cap_restores: int = 0  # times the row cap came back to max_rows once the requeued requests were served
    notes: list[str] = field(default_factory=list)  # one line per memory event, in order


class Engine:
    """Continuous batching of decoder rows over one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, max_rows: int | None = None, max_memory: int | None = None,
                 budget_memory: bool = False, packed_attention: bool | None = None):
        """``max_rows``: the most rows at once (None: no bound but memory). ``budget_memory`` (or a
        ``max_memory`` in bytes) admits rows while the memory model's bytes fit the budget
        (``memory.memory_budget``: ``max_memory``, a GPU's free memory or the RAM available).
        ``packed_attention``: one attention call per layer for all the rows of a call (None: on CUDA)."""
        self.model = model
        self.packed_attention = packed_attention
        self.device = next(model.parameters()).device
        self.max_rows = max_rows
        self.row_cap: int | None = max_rows  # lowered while the requests of a call that ran out of memory run
        self.requeued: set[int] = set()  # those requests, by id, until each has left
        self.size: ModelSize | None = None
        self.row_budget: int | None = None  # bytes the rows may take (None: not bounded)
        self.budget, self.source = 0, ""
        if budget_memory or max_memory is not None:
            self.size = ModelSize.of(model)
            self.budget, self.source = memory_budget(self.device, max_memory, self.size.weights)
            self.row_budget = self.budget - self.size.weights - reserve(self.budget)
        self.counts = EngineCounts()
        self.callback_time = CallbackTime()  # the step callbacks' time, kept out of every row's latency
        self.on_call: Callable[[int], None] | None = None  # told the rows of every model call (metrics)
        self.on_requeue: Callable[[], None] | None = None  # told of every call that ran out of memory
        self.waiting: deque[Request] = deque()
        self.running: dict[int, _Row] = {}
        # the shared-calls object of each kind (registry.calls_kind), made at its first row; a caller may put its
        # own in first (a test records the calls this way)
        self.calls: dict[tuple[str, bool], ModelRunner] = {}

    # --- submitting ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Drop ``request``: waiting, it never starts; running, its row leaves before the next call."""
        request.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def row_bytes(self, request: Request) -> int:
        if self.size is None:
            return 0
        return row_memory_bytes(request.decoder, request.config, request.prompt.numel(), self.size)

    def rows_that_fit(self, decoder: str, config: Any, prompt_length: int, requests: int) -> BatchChoice | None:
        """How many of ``requests`` rows of ``decoder`` at a ``prompt_length``-token prompt the memory budget
        holds at once, and why (None: the engine has no budget)."""
        if self.size is None:
            return None
        row = row_memory_bytes(decoder, config, prompt_length, self.size)
        cap = requests if self.max_rows is None else min(requests, self.max_rows)
        return fitting_batch(self.budget, self.size.weights, row, cap, self.source)

    # --- one round ----------------------------------------------------------------------------

    def step(self) -> None:
        """Admit, drop the cancelled, make one model call per kind of the running rows."""
        self.counts.steps += 1
        for row in self._admit():
            self._advance(row, None)
        self._read_back()
        for row in [row for row in self.running.values() if row.request.cancelled]:
            row.program.close()
            self._retire(row, None)
        for kind, calls in list(self.calls.items()):
            rows = [row for row in self.running.values() if row.calls is calls]
            if rows:
                self._call(kind, calls, rows)
        self._read_back()

    def _read_back(self) -> None:
        """Send every row that waits on device values its values, read for all of them at once, until each
        waits on a model call (a row may need a second readback that depends on the first)."""
        while True:
            rows = [row for row in self.running.values() if isinstance(row.feed, (Readback, Batched))]
            if not rows:
                return
            try:
                values = read_all([row.feed for row in rows])
            except Exception as error:  # the device failed under these rows: they fail, the others go on
                log.debug("reading back %d rows failed", len(rows), exc_info=True)
                for row in rows:
                    row.program.close()
                    self._retire(row, Failed(f"the decode failed: {error}", error))
                continue
            self.counts.readbacks += 1
            for row, value in zip(rows, values):
                self._advance(row, value)

    def run(self) -> None:
        """Step until nothing waits or runs."""
        while self.busy:
            self.step()

    def _fits(self, request: Request, rows: int, used: int) -> bool:
        if rows == 0:
            return True  # one row always runs: a memory error of a lone row fails its request
        if self.row_cap is not None and rows >= self.row_cap:
            return False
        return self.row_budget is None or used + self.row_bytes(request) <= self.row_budget

    def _admit(self) -> list[_Row]:
        admitted: list[_Row] = []
        used = sum(row.nbytes for row in self.running.values())
        while self.waiting:
            request = self.waiting[0]
            if request.cancelled:
                self._left(self.waiting.popleft())
                continue
            if not self._fits(request, len(self.running), used):
                break
            self.waiting.popleft()
            row = self._open(request)
            if row is not None:
                used += row.nbytes
                admitted.append(row)
        return admitted

    def _open(self, request: Request) -> _Row | None:
        kind = calls_kind(request.decoder, request.kv_reuse)
        if kind not in self.calls:
            self.calls[kind] = shared_calls(kind, self.model, self.packed_attention)
        calls = self.calls[kind]
        generator = request.generator
        state = generator.get_state() if generator is not None else None
        clock = RowClock(self.device, self.callback_time)  # the row's latency runs from its admission
        row = _Row(request, iter(()), calls, clock, self.row_bytes(request), state)  # type: ignore[arg-type]
        wants_steps = request.on_step is not None or request.stop is not None
        try:
            row.program = decoder_spec(request.decoder).open_row(
                calls, request.id, request.prompt, request.config, request.options, generator,
                (lambda record: self._on_step(row, record)) if wants_steps else None, clock)
        except Exception as error:  # a row that cannot start fails its request only
            log.debug("request %d could not start", request.id, exc_info=True)
            calls.close(request.id)  # whatever the opener had opened in the shared calls
            self._left(request)
            request.done(Failed(f"the decode could not start: {error}", error))
            return None
        self.running[request.id] = row
        return row

    def _on_step(self, row: _Row, record: Any) -> None:
        row.records += 1
        if row.request.stop is not None and row.stop_at is None:
            for commit in commits(record):
                row.committed[commit.offset] = commit.token
            while len(row.prefix) in row.committed:  # the prefix grows by what now joins it, never rebuilt
                row.prefix.append(row.committed.pop(len(row.prefix)))
            row.stop_at = row.request.stop(row.prefix)
        if row.request.on_step is not None and row.records > row.request.reported:
            row.request.reported = row.records
            row.request.on_step(record)

    def _advance(self, row: _Row, reply: Any) -> None:
        """Send ``reply`` to the row's program (None: start it) and keep its next feed, or retire it."""
        try:
            row.feed = next(row.program) if reply is None else row.program.send(reply)
        except StopIteration as stop:
            result: DecodeResult = stop.value
            result.stats.seconds = row.clock.latency()
            self._retire(row, Finished(result))
            return
        except Exception as error:  # this request's decode failed; the others go on
            log.debug("request %d failed", row.request.id, exc_info=True)
            self._retire(row, Failed(f"the decode failed: {error}", error))
            return
        if row.stop_at is not None:
            row.program.close()
            prefix = row.prefix[: row.stop_at]
            stats = DecodeStats(forwards=row.forwards, tokens=len(prefix), seconds=row.clock.latency())
            self._retire(row, Finished(DecodeResult(prefix, stats), stopped=True))

    def _call(self, kind: tuple[str, bool], calls: ModelRunner, rows: list[_Row]) -> None:
        """One model call of every row's feed, each row sent its reply."""
        try:
            replies = calls.forward({row.request.id: row.feed for row in rows})
        except Exception as error:
            del self.calls[kind]  # its K/V may be half written: the next call of the kind starts afresh
            for row in rows:
                self.running.pop(row.request.id, None)
                row.program.close()
            if is_out_of_memory(error) and len(rows) > 1:
                self._requeue(rows)
                return
            log.debug("a model call of %d rows failed", len(rows), exc_info=True)
            for row in rows:
                self._left(row.request)
                row.request.done(Failed(f"the model call failed: {error}", error))
            return
        self.counts.peak_rows = max(self.counts.peak_rows, len(rows))
        if self.on_call is not None:
            self.on_call(len(rows))
        for row in rows:
            row.forwards += 1
            self._advance(row, replies[row.request.id])

    def _requeue(self, rows: list[_Row]) -> None:
        """Put the rows of a call that ran out of memory back at the front of the queue, in their order."""
        self.row_cap = max(1, (len(rows) + 1) // 2)
        self.requeued.update(row.request.id for row in rows)
        self.counts.oom_requeues += 1
        note = f"out of memory in a call of {len(rows)} rows: requeued them, at most {self.row_cap} rows from now"
        self.counts.notes.append(note)
        log.warning(note)
        if self.on_requeue is not None:
            self.on_requeue()
        for row in reversed(rows):
            if row.generator_state is not None and row.request.generator is not None:
                row.request.generator.set_state(row.generator_state)
            self.waiting.appendleft(row.request)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _left(self, request: Request) -> None:
        """A request is done with the engine: once every requeued one is, the row cap is ``max_rows`` again."""
        if request.id not in self.requeued:
            return
        self.requeued.discard(request.id)
        if not self.requeued:
            self.row_cap = self.max_rows
            self.counts.cap_restores += 1
            log.info("the requests of the calls that ran out of memory have left: at most %s rows again",
                     self.max_rows or "any number of")

    def _retire(self, row: _Row, outcome: Outcome | None) -> None:
        self.running.pop(row.request.id, None)
        row.calls.close(row.request.id)
        self._left(row.request)
        if outcome is not None:
            row.request.done(outcome)


# ---------------------------------------------------------------------------------------------
# submit all, wait for all


@overload
def run_decoder(decoder: str, model: torch.nn.Module, prompt_ids: Prompts, config: Any, *,
                mask_token_id: int | None, eos_token_id: EosIds, generator: Generators = None,
                on_step: Callable[[int, Any], None] | None = None, kv_reuse: bool = True, causal_fix: bool = False,
                causal_first: bool = False, recheck: bool = False, batch_size: int | None = None,
                max_memory: int | None = None, engine: Engine | None = None,
                on_result: Callable[[int, DecodeResult], None] | None = None) -> list[DecodeResult]: ...


@overload
def run_decoder(decoder: str, model: torch.nn.Module, prompt_ids: Prompt, config: Any, *,
                mask_token_id: int | None, eos_token_id: EosIds, generator: Generators = None,
                on_step: Callable[[Any], None] | None = None, kv_reuse: bool = True, causal_fix: bool = False,
                causal_first: bool = False, recheck: bool = False, batch_size: int | None = None,
                max_memory: int | None = None, engine: Engine | None = None,
                on_result: Callable[[int, DecodeResult], None] | None = None) -> DecodeResult: ...


@torch.inference_mode()
def run_decoder(
    decoder: str,
    model: torch.nn.Module,
    prompt_ids: Prompt | Prompts,
    config: Any,
    *,
    mask_token_id: int | None,
    eos_token_id: EosIds,
    generator: Generators = None,
    on_step: Callable[..., None] | None = None,
    kv_reuse: bool = True,
    causal_fix: bool = False,
    causal_first: bool = False,
    recheck: bool = False,
    batch_size: int | None = None,
    max_memory: int | None = None,
    engine: Engine | None = None,
    on_result: Callable[[int, DecodeResult], None] | None = None,
) -> DecodeResult | list[DecodeResult]:
    """Decode one prompt with the named decoder, or a batch (a list of prompts: one result per prompt,
    in order, ``on_step(prompt_index, record)``); ``kv_reuse``, ``causal_fix``, ``causal_first`` and
    ``recheck`` are ReFusion's ablations.

    The prompts go through one :class:`Engine`: at most ``batch_size`` rows (None: all) at once, and with
    ``max_memory`` (bytes) as many as its budget holds; a finished row's place goes to the next prompt.
    A result's ``seconds`` is its row's latency, from its admission to its end. ``engine``: an engine of the caller's
    (its bounds, its counts), else a new one. ``on_result(index, result)`` sees each prompt's result as soon
    as it finishes (a caller that records samples as they come: nothing finished is lost to an interruption).

    It runs in inference mode, as serve's scheduler does: no autograd bookkeeping on any op (the tiny models'
    decodes are 10-17 % faster than under no_grad); every result is host values."""
    spec = decoder_spec(decoder)
    if not isinstance(config, spec.config_class):
        raise UserError(f"the {decoder} decoder takes a {spec.config_class.__name__}, not {type(config).__name__}")
    if spec.needs_mask and mask_token_id is None:
        raise UserError(f"the {decoder} decoder needs a model with a mask token")
    batch, prompts = batch_prompts(model, prompt_ids, batch_size, response_budget(config),
                                   mask_token_id=mask_token_id if spec.needs_mask else None, eos_token_id=eos_token_id)
    generators = row_generators(generator, len(prompts))
    options = row_options(decoder, mask_token_id, eos_token_id, (causal_fix, causal_first, recheck))
    if engine is None:
        engine = Engine(model, max_rows=batch_size, max_memory=max_memory)
    outcomes: list[Outcome | None] = [None] * len(prompts)
    for index, prompt in enumerate(prompts):
        engine.submit(Request(decoder, prompt, config, options, done=_keep(outcomes, index, on_result),
                              generator=generators[index], kv_reuse=kv_reuse,
                              on_step=row_callback(on_step, index, batch)))
    engine.run()
    results = [_result(outcome) for outcome in outcomes]
    return results if batch else results[0]


def _keep(outcomes: list[Outcome | None], index: int,
          on_result: Callable[[int, DecodeResult], None] | None) -> Callable[[Outcome], None]:
    def keep(outcome: Outcome) -> None:
        outcomes[index] = outcome
        if on_result is not None and isinstance(outcome, Finished):
            on_result(index, outcome.result)
    return keep


def _result(outcome: Outcome | None) -> DecodeResult:
    if isinstance(outcome, Finished):
        return outcome.result
    if isinstance(outcome, Failed) and outcome.error is not None:
        raise outcome.error
    raise RuntimeError(outcome.message if isinstance(outcome, Failed) else "a request never finished")


__all__ = ["Engine", "EngineCounts", "Failed", "Finished", "Outcome", "Request", "StopRule", "run_decoder"]
