"""The result type shared by every decoder, and the one counting rule they all follow.

Counting rule: ``tokens`` is the number of response tokens up to and including the first EOS
(the first token that is any of the model's EOS ids; the whole response if there is none);
``forwards`` counts every call of the model, whatever it was for (planning, verification,
drafting, a CFG pass); ``seconds`` is the wall time of the whole decode call, less the time spent
in the caller's ``on_step`` callback (a live view's drawing is not decoding). TPS = tokens / seconds
and TPF = tokens / forwards.

A batched decode (several prompts at once) keeps these counters per prompt: ``forwards`` counts the
model calls that prompt's row took part in, ``positions`` the positions it fed, ``seconds`` is its
latency (from its admission until it finished, less the callback time meanwhile: :class:`RowClock`), so
a request's TPS does not depend on how many requests came before it. A batch's throughput is its total
tokens over the wall time of the whole run, which the caller measures.

Over a run of many decodes (a benchmark in ``refusion eval``, a row of ``refusion bench``) the TPS is
:func:`run_tps`: the decodes' tokens over their summed seconds, as the paper's ``eval.py`` counts it
(mean generated length over mean latency). The mean of the per-decode TPS, which weighs a short
answer as much as a long one, is reported beside it as a secondary figure (:func:`mean_tps`).
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


@dataclass
class DecodeStats:
    forwards: int = 0  # model calls of any kind
    tokens: int = 0  # response tokens up to and including EOS
    seconds: float = 0.0  # wall time of the decode call
    positions: int = 0  # token positions the model computed (rows x input length, summed over calls)
    forward_seconds: float | None = 0.0  # wall time inside model calls; None on a GPU (see timed_call)
    callback_seconds: float = 0.0  # wall time spent in the caller's on_step (not part of ``seconds``)

    @property
    def tpf(self) -> float:
        """Tokens per forward."""
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tps(self) -> float:
        """Tokens per second of wall time."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "forwards": self.forwards,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tpf": self.tpf,
            "tps": self.tps,
            "positions": self.positions,
            "forward_seconds": self.forward_seconds,
        }


@dataclass
class DecodeResult:
    tokens: list[int]  # response ids in position order, cut after the first EOS
    stats: DecodeStats
    trace: list[Any] = field(default_factory=list)  # per-iteration records (decoder specific)


def run_tps(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """A run's tokens per second: its generated tokens over its summed decode seconds (0 for no time)."""
    total = sum(seconds)
    return sum(tokens) / total if total > 0 else 0.0


def mean_tps(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """The mean of the per-decode TPS (a decode that took no time counts as 0), beside :func:`run_tps`."""
    rates = [n / s if s > 0 else 0.0 for n, s in zip(tokens, seconds, strict=True)]
    return sum(rates) / len(rates) if rates else 0.0


EosIds = int | Sequence[int] | None  # one EOS id, several (any of them ends a response) or none


def eos_ids(eos_token_id: EosIds) -> tuple[int, ...]:
    """The EOS ids as a tuple: ``None`` is none, an int is one, a sequence is each of its ids."""
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(token) for token in eos_token_id)


def cut_after_eos(tokens: list[int], eos_token_id: EosIds) -> list[int]:
    """Keep tokens up to and including the first EOS (the first token that is any of the EOS ids)."""
    stops = set(eos_ids(eos_token_id))
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class CallbackTime:
    """Seconds spent in callers' step callbacks, summed over all rows of one engine (they run on the
    thread that steps it, so every running row waits for them)."""

    seconds: float = 0.0


class RowClock:
    """A row's wall clock: its latency from its admission to now, less the callback time meanwhile.

    Started on creation; :meth:`report` hands a record to the caller's callback and adds its time to the
    shared :class:`CallbackTime`; :meth:`latency` is the time since the start less the callback time added
    since. Neither end waits for the device: a row ends on values read back from it (``decoding.readback``),
    which waited for its work already, and a row admitted while the device is busy waits for that work as a
    request would. A caller that times a whole run synchronises at both ends of it.
    """

    def __init__(self, device: torch.device, callbacks: CallbackTime | None = None):
        self.device = device
        self.callbacks = callbacks if callbacks is not None else CallbackTime()
        self._start = time.perf_counter()
        self._callbacks_at_start = self.callbacks.seconds

    def report(self, stats: DecodeStats, on_step: Callable[[Any], None] | None, record: Any) -> None:
        """:func:`report_step`, its time also kept out of every running row's latency."""
        before = stats.callback_seconds
        report_step(stats, on_step, record)
        self.callbacks.seconds += stats.callback_seconds - before

    def latency(self) -> float:
        return time.perf_counter() - self._start - (self.callbacks.seconds - self._callbacks_at_start)


def report_step(stats: DecodeStats, on_step: Callable[[Any], None] | None, record: Any) -> None:
    """Hand ``record`` to the caller's ``on_step``; its time is kept out of the decode's ``seconds``."""
    if on_step is None:
        return
    start = time.perf_counter()
    on_step(record)
    stats.callback_seconds += time.perf_counter() - start


def timed_call(model: torch.nn.Module, **inputs: Any) -> tuple[Any, float | None]:
    """``model(**inputs)`` and its wall time, measured on the CPU only, where a call returns when its work
    is done. On a GPU it would take a synchronisation before and after every call, which stalls the queue
    inside the timed decode; there the time is None (and ``forward_seconds`` with it, see
    :func:`count_call`) and only the whole decode is timed, synchronised at both ends."""
    start = time.perf_counter()
    out = model(**inputs)
    return out, (time.perf_counter() - start if inputs["input_ids"].device.type == "cpu" else None)


def count_call(stats: DecodeStats, positions: int, seconds: float | None) -> None:
    """Record one model call that fed ``positions`` positions for ``stats``' decode and took ``seconds``."""
    if seconds is None or stats.forward_seconds is None:
        stats.forward_seconds = None
    else:
        stats.forward_seconds += seconds
    stats.forwards += 1
    stats.positions += positions


def last_logits(model: torch.nn.Module, n: int) -> dict[str, int]:
    """Keyword asking ``model`` for the logits of its last ``n`` (>= 1) input positions only.

    transformers' causal LMs take ``logits_to_keep``; with a 150k-word vocabulary the logits of
    positions nobody reads (the prompt, recomputed context) cost more memory than the K/V. A model
    whose forward lacks the keyword gets nothing here, and the caller slices.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    return {"logits_to_keep": n} if _keeps_logits(type(model).forward) else {}


def logits_at(model: torch.nn.Module, columns: torch.Tensor, width: int,
              last: bool | None = None) -> dict[str, int | torch.Tensor]:
    """Keyword asking ``model`` for the logits of input columns ``columns`` only (ascending [U] of ``width``).

    Nothing when they are every column, the count when they are the last ones (as :func:`last_logits`),
    else the index tensor (transformers applies one 1-D index to every row of the batch). A model whose
    forward lacks the keyword gets nothing, and :func:`kept_logits` slices what it returns. ``last``: whether
    they are the last ones, when the caller knows (else it is read from ``columns``, a wait on a GPU)."""
    if columns.numel() == width or not _keeps_logits(type(model).forward):
        return {}
    if last is None:
        last = bool(columns.numel()) and int(columns[0]) == width - columns.numel()
    if last and columns.numel():  # ascending and unique: the last U columns
        return {"logits_to_keep": columns.numel()}
    return {"logits_to_keep": columns}  # also none at all: an int 0 would mean every column


def kept_logits(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[B, U, V]: the logits of ``columns`` from a call asked for them (:func:`logits_at`); a model that
    computed every column is sliced here."""
    return logits if logits.shape[1] == columns.numel() else logits[:, columns]


@functools.cache
def _keeps_logits(forward: Callable[..., Any]) -> bool:
    """Keyed by the class's forward function (what the answer depends on), which every class sharing it shares."""
    return "logits_to_keep" in inspect.signature(forward).parameters


def cache_argument(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """Keyword that hands ``model`` its KV cache: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier releases, and remote code written for them).

    Passing the wrong one is silent: the model's ``**kwargs`` swallow it and the model runs
    without the cache. A forward that names neither gets ``cache`` if it takes ``**kwargs``; one
    that takes neither at all is an error.
    """
    name = _cache_keyword(type(model).forward)
    if name is None:
        raise TypeError(f"{type(model).__name__}.forward takes no KV cache (neither 'cache' nor 'past_key_values')")
    return {name: cache}


@functools.cache
def _cache_keyword(forward: Callable[..., Any]) -> str | None:
    parameters = inspect.signature(forward).parameters
    named = next((name for name in ("cache", "past_key_values") if name in parameters), None)
    if named is None and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return "cache"
    return named


def wide_float(device: torch.device) -> torch.dtype:
    """float64 for noise and ranking, except on Apple's MPS, which has no float64 (float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def float_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 for probabilities (float64 models keep float64, for exact tests)."""
    return logits if logits.dtype == torch.float64 else logits.float()
