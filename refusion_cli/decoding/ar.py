"""Autoregressive decoding with a KV cache: one token per forward (the AR baseline), greedy at temperature 0,
else drawn from the top-p nucleus of softmax(logits / temperature) with the row's own generator.

:func:`ar_row` is one prompt's program on a sequence of :class:`~refusion_cli.decoding.cache.CausalRunner` (its
own rows of the shared KV cache); ``engine.run_decoder("ar", ...)`` runs one per prompt and every
round feeds each running sequence its last token in one model call; a finished sequence leaves and the next
prompt takes its row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from refusion_cli.decoding.cache import CausalRunner, CausalSequence, SequenceStep
from refusion_cli.decoding.config import ARConfig
from refusion_cli.decoding.dream import filter_logits
from refusion_cli.decoding.mdm_sampling import sample
from refusion_cli.decoding.readback import read
from refusion_cli.decoding.stats import RowClock, DecodeResult, DecodeStats


@dataclass
class ARStep:
    """One step (what ``on_step`` sees of AR): the one token it committed, with its response offset,
    in the fields the other decoders' records have."""

    offsets: list[int]
    tokens: list[int]


def ar_row(runner: CausalRunner, index: int, prompt: torch.Tensor, config: ARConfig, stops: set[int],
           on_step: Callable[[ARStep], None] | None = None, clock: RowClock | None = None,
           generator: torch.Generator | None = None) -> SequenceStep[DecodeResult]:
    """Open sequence ``index`` for ``prompt`` [P] and return its program; ``on_step`` sees every token, its time
    kept out of the latency by ``clock``; ``generator`` draws the tokens when ``config.temperature`` > 0."""
    stats = DecodeStats()
    report = None if on_step is None or clock is None else functools.partial(clock.report, stats, on_step)
    pick = functools.partial(next_token, config=config, generator=generator)
    # the prompt but its last token is committed; the last one is fed, its logits give the first token
    return ar_program(runner.open(index, stats, prompt[:-1]), stats, prompt[-1:], config.gen_length, stops, pick,
                   report)


def next_token(logits: torch.Tensor, config: ARConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The token after ``logits`` [V], on the device ([1]): the argmax at temperature 0, else a draw from the
    top-p nucleus."""
    if config.temperature == 0:
        return logits.argmax().view(1)
    scaled = logits.float()[None] / config.temperature  # [1, V]
    weights = filter_logits(scaled, config.top_p, None).softmax(-1)
    return sample(weights, 1, generator).view(1)


def ar_program(ctx: CausalSequence, stats: DecodeStats, last: torch.Tensor, max_new_tokens: int, stops: set[int],
               pick: Callable[[torch.Tensor], torch.Tensor], report: Callable[[Any], None] | None = None
               ) -> SequenceStep[DecodeResult]:
    """One prompt's decode as a sequence's program: feed the last token, commit it, ``pick`` the next from its logits
    (on the device: the next call feeds it from there; the host reads it with every other row's)."""
    tokens: list[int] = []
    position = torch.tensor([ctx.length], device=last.device)  # [1]
    for _ in range(max_new_tokens):
        logits = yield from ctx.forward(last, position)  # [1, V]
        ctx.commit(1)
        last = pick(logits[-1])  # [1]
        (token,), = yield from read(last)
        tokens.append(token)
        if report is not None:
            report(ARStep([len(tokens) - 1], [token]))
        if token in stops:
            break
        position = position + 1
    stats.tokens = len(tokens)
    return DecodeResult(tokens=tokens, stats=stats)


__all__ = ["ARStep", "ar_program", "ar_row", "next_token"]
