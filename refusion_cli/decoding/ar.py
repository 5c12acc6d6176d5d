"""Greedy autoregressive decoding with a KV cache: one token per forward (the AR baseline).

One prompt, or a batch: each prompt is a lane of :class:`~refusion_cli.decoding.cache.Lanes` (its
own rows of the shared KV cache), and every round feeds each running lane its last token in one
model call; a finished lane leaves and the next prompt takes its row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, overload

import torch

from refusion_cli.decoding.batching import Prompt, Prompts, batch_prompts
from refusion_cli.decoding.cache import Lane, Lanes, LaneStep, drive
from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.stats import BatchClock, DecodeResult, DecodeStats, EosIds, eos_ids


@overload
def decode_ar(model: torch.nn.Module, prompt_ids: Prompts, *, max_new_tokens: int, eos_token_id: EosIds,
              batch_size: int | None = None) -> list[DecodeResult]: ...


@overload
def decode_ar(model: torch.nn.Module, prompt_ids: Prompt, *, max_new_tokens: int, eos_token_id: EosIds,
              batch_size: int | None = None) -> DecodeResult: ...


@torch.no_grad()
def decode_ar(
    model: torch.nn.Module,
    prompt_ids: Prompt | Prompts,
    *,
    max_new_tokens: int,
    eos_token_id: EosIds,
    batch_size: int | None = None,
) -> DecodeResult | list[DecodeResult]:
    """Greedy next-token decoding; stops after an EOS (any of the ids given) or ``max_new_tokens`` tokens.

    A batch (a list of prompts) returns one result per prompt, in order; ``batch_size`` rows (None:
    all) decode at once, each exactly as alone (same tokens, one forward per token)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    batch, prompts = batch_prompts(model, prompt_ids, batch_size, max_new_tokens, eos_token_id=eos_token_id)
    stops = set(eos_ids(eos_token_id))
    lanes = Lanes(model)
    clock = BatchClock(prompts[0].device)

    def start(index: int) -> LaneStep[DecodeResult]:
        return ar_row(lanes, index, prompts[index], max_new_tokens, stops)

    results = drive(lanes, start, len(prompts), batch_size, clock)
    return results if batch else results[0]


@dataclass
class ARStep:
    """One greedy step (what ``on_step`` sees of AR): the one token it committed, with its response offset,
    in the fields the other decoders' records have."""

    offsets: list[int]
    tokens: list[int]


def ar_row(lanes: Lanes, index: int, prompt: torch.Tensor, max_new_tokens: int, stops: set[int],
           on_step: Callable[[ARStep], None] | None = None, clock: BatchClock | None = None) -> LaneStep[DecodeResult]:
    """Open lane ``index`` for ``prompt`` [P] and return its greedy program; ``on_step`` sees every token,
    its time kept out of the latency by ``clock``."""
    stats = DecodeStats()
    report = None if on_step is None or clock is None else functools.partial(clock.report, stats, on_step)
    # the prompt but its last token is committed; the last one is fed, its logits give the first token
    return greedy_lane(lanes.open(index, stats, prompt[:-1]), stats, prompt[-1:], max_new_tokens, stops, report)


def greedy_lane(ctx: Lane, stats: DecodeStats, last: torch.Tensor, max_new_tokens: int,
                stops: set[int], report: Callable[[Any], None] | None = None) -> LaneStep[DecodeResult]:
    """One prompt's greedy decode as a lane program: feed the last token, commit it, take the argmax."""
    tokens: list[int] = []
    position = torch.tensor([ctx.length], device=last.device)  # [1]
    for _ in range(max_new_tokens):
        logits = yield from ctx.forward(last, position)  # [1, V]
        ctx.commit(1)
        token = int(logits[-1].argmax())
        tokens.append(token)
        if report is not None:
            report(ARStep([len(tokens) - 1], [token]))
        if token in stops:
            break
        last, position = torch.tensor([token], device=last.device), position + 1
    stats.tokens = len(tokens)
    return DecodeResult(tokens=tokens, stats=stats)


__all__ = ["ARStep", "ar_row", "decode_ar", "greedy_lane"]
