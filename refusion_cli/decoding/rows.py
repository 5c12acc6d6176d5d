"""Decoding one prompt at a time as a *row*, for a caller that owns the loop: a server that admits and
retires rows between two model calls (step-level continuous batching).

Every decoder here is a row program (a generator that yields one feed per model call and is sent its
logits back) over a shared-calls object that makes one padded call of every running row's feed:
:class:`~refusion_cli.decoding.cache.Lanes` for the causal decoders (ReFusion, AR; one KV cache, a
lane per row), :class:`~refusion_cli.decoding.mdm.CanvasCalls` for the masked-diffusion ones (LLaDA,
Dream, their Fast-dLLM settings, D2F). ``run_decoder`` drives a fixed list of prompts through the same
programs (``cache.drive``); here the caller drives them:

- :func:`shared_calls` makes the calls object a group of rows shares (rows of one kind only);
- :func:`open_row` opens row ``index`` in it and returns the row's program, which decodes exactly as
  ``run_decoder`` decodes that prompt alone; ``calls.close(index)`` ends it (finished or dropped);
- :func:`response_budget` is the number of positions the decoder appends to a prompt (for the
  context check), :func:`commits` what one ``on_step`` record committed, as (offset, token, kind).

Token ids in; nothing here knows of text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generator

import torch

from refusion_cli.decoding.ar import ARStep, ar_row
from refusion_cli.decoding.cache import Lanes, SharedCalls
from refusion_cli.decoding.config import ARConfig, ReFusionConfig
from refusion_cli.decoding.d2f import D2FConfig, d2f_row
from refusion_cli.decoding.dream import dream_row
from refusion_cli.decoding.llada import LLaDAConfig, llada_row
from refusion_cli.decoding.mdm import CanvasCalls, MDMStep, canvas_row
from refusion_cli.decoding.refusion import StepTrace, refusion_row
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.decoding.stats import BatchClock, DecodeResult, EosIds, eos_ids
from refusion_cli.decoding.variants import PAPER, Variant

RowProgram = Generator[Any, Any, DecodeResult]

NEXT, UNMASKED = "next", "unmasked"  # the commit kinds of AR and of the masked-diffusion samplers


@dataclass(frozen=True)
class Commit:
    """One token committed at a response offset, and how it got in: ReFusion's "first" / "verified" /
    "forced" / ..., a masked-diffusion sampler's "unmasked", AR's "next"."""

    offset: int
    token: int
    kind: str


def calls_kind(decoder: str, variant: Variant = PAPER, kv_reuse: bool = True) -> tuple[str, bool]:
    """Which shared-calls object rows of ``decoder`` run in: rows of one kind share one."""
    if decoder_spec(decoder).bidirectional:
        return ("canvas", True)
    return ("lanes", kv_reuse)


def shared_calls(kind: tuple[str, bool], model: torch.nn.Module) -> SharedCalls:
    """A new calls object of ``kind`` (see :func:`calls_kind`) on ``model``."""
    name, reuse = kind
    return CanvasCalls(model) if name == "canvas" else Lanes(model, reuse=reuse)


def response_budget(config: Any) -> int:
    """Positions a decode with ``config`` appends to its prompt (ReFusion rounds up to whole slots)."""
    if isinstance(config, ReFusionConfig):
        return config.padded_length
    if isinstance(config, D2FConfig):
        return config.response_length
    return config.gen_length


def open_row(decoder: str, calls: SharedCalls, index: int, prompt: torch.Tensor, config: Any, *,
             mask_token_id: int | None, eos_token_id: EosIds, generator: torch.Generator | None = None,
             variant: Variant = PAPER, on_step: Callable[[Any], None] | None = None,
             clock: BatchClock | None = None) -> RowProgram:
    """Open row ``index`` of ``calls`` for ``prompt`` [P] (on the model's device) and return its program.

    ``on_step`` sees the decoder's records (ReFusion's ``StepTrace``, the samplers' ``MDMStep``, AR's
    ``ARStep``); ``clock`` keeps its time out of the row's latency. Checks are the caller's (the prompt's
    ids and length: ``batching.check_ids``; the config's class)."""
    spec = decoder_spec(decoder)
    if isinstance(config, ARConfig):
        return ar_row(calls, index, prompt, config.gen_length, set(eos_ids(eos_token_id)), on_step, clock)
    if isinstance(config, ReFusionConfig):
        causal_fix, causal_first, recheck = variant
        return refusion_row(calls, index, prompt, config, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
                            generator=generator, causal_fix=causal_fix, causal_first=causal_first,
                            recheck=recheck, on_step=on_step, clock=clock)
    if isinstance(config, D2FConfig):
        def program(canvas, row_generator):
            return d2f_row(canvas, config, bool(spec.shifted), row_generator)
    elif isinstance(config, LLaDAConfig):
        def program(canvas, row_generator):
            return llada_row(canvas, config, row_generator)
    else:
        def program(canvas, row_generator):
            return dream_row(canvas, config, row_generator)
    return canvas_row(prompt, response_budget(config), program, mask_token_id=mask_token_id,
                      eos_token_id=eos_token_id, generator=generator, on_step=on_step, clock=clock)


def commits(record: Any) -> list[Commit]:
    """What one ``on_step`` record committed, in commit order."""
    if isinstance(record, StepTrace):
        return [Commit(offset, token, kind) for offset, token, kind in
                zip(record.offsets, record.tokens, record.kinds, strict=True)]
    if isinstance(record, ARStep):
        return [Commit(record.offset, record.token, NEXT)]
    if isinstance(record, MDMStep):
        return [Commit(offset, token, UNMASKED) for offset, token in zip(record.offsets, record.tokens, strict=True)]
    raise TypeError(f"not a decoder step record: {type(record).__name__}")


__all__ = ["NEXT", "UNMASKED", "Commit", "RowProgram", "calls_kind", "commits", "open_row", "response_budget",
           "shared_calls"]
