"""Decoding one prompt as a *row* of the engine (``decoding.engine``), which admits and retires rows between
two model calls (step-level continuous batching).

Every decoder is a row program (a generator that yields one feed per model call and is sent its
logits back) over a shared-calls object that makes one call of every running row's feed:
:class:`~refusion_cli.decoding.cache.CausalRunner` for the causal decoders (ReFusion, AR; one packed call, a row
of the K/V store per sequence), :class:`~refusion_cli.decoding.mdm.CanvasRunner` for the masked-diffusion ones (LLaDA,
Dream, their Fast-dLLM settings, D2F). The engine drives them:

- :func:`shared_calls` makes the calls object a group of rows shares (rows of one kind only);
- each decoder's *row opener* (``ar_rows``, ``refusion_rows``, ``llada_rows``, ...; the registry entry's
  ``open_row``, which ``registry.open_row`` looks up) opens row ``index`` in it and returns the row's program;
  ``calls.close(index)`` ends it (finished or dropped). ``engine.run_decoder`` drives a list of prompts
  through the same openers, so a row decodes exactly as ``run_decoder`` decodes that prompt alone;
- :func:`response_budget` is the number of positions the decoder appends to a prompt (for the
  context check), :func:`commits` what one ``on_step`` record committed, as (offset, token, kind).

Token ids in; nothing here knows of text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generator, cast

import torch

from refusion_cli.decoding.ar import ARStep, ar_row
from refusion_cli.decoding.cache import CausalRunner, ModelRunner
from refusion_cli.decoding.config import ReFusionConfig
from refusion_cli.decoding.d2f import D2FConfig, d2f_row
from refusion_cli.decoding.dream import dream_row
from refusion_cli.decoding.llada import llada_row
from refusion_cli.decoding.mdm import Canvas, CanvasRunner, CanvasStep, MDMStep, canvas_row
from refusion_cli.decoding.refusion import StepTrace, refusion_row
from refusion_cli.decoding.stats import RowClock, DecodeResult, EosIds, eos_ids
from refusion_cli.decoding.variants import PAPER, Variant

RowProgram = Generator[Any, Any, DecodeResult]

NEXT, UNMASKED = "next", "unmasked"  # the commit kinds of AR and of the masked-diffusion samplers
CAUSAL, CANVAS = "causal", "canvas"  # the model runners: cache.CausalRunner, mdm.CanvasRunner


@dataclass(frozen=True)
class Commit:
    """One token committed at a response offset, and how it got in: ReFusion's "first" / "verified" /
    "forced" / ..., a masked-diffusion sampler's "unmasked", AR's "next"."""

    offset: int
    token: int
    kind: str


def shared_calls(kind: tuple[str, bool], model: torch.nn.Module, packed: bool | None = None) -> ModelRunner:
    """A new calls object of ``kind`` (``(CAUSAL, kv_reuse)`` or ``(CANVAS, True)``) on ``model``; ``packed``:
    one attention call per layer for every row (None: on CUDA)."""
    name, reuse = kind
    return CanvasRunner(model, packed=packed) if name == CANVAS else CausalRunner(model, reuse=reuse, packed=packed)


def response_budget(config: Any) -> int:
    """Positions a decode with ``config`` appends to its prompt (ReFusion rounds up to whole slots)."""
    if isinstance(config, ReFusionConfig):
        return config.padded_length
    if isinstance(config, D2FConfig):
        return config.response_length
    return config.gen_length


@dataclass(frozen=True)
class RowOptions:
    """What every row of one decode shares besides its prompt, config and generator."""

    mask_token_id: int | None
    eos_token_id: EosIds
    shifted: bool = False  # the masked-diffusion decoders: read token p from the logits of p - 1 (Dream)
    variant: Variant = PAPER  # ReFusion's variant (decoding.variants)

    @property
    def mask_id(self) -> int:
        """The mask token id, which a decoder that needs one is always given (``engine`` refuses a decode without)."""
        if self.mask_token_id is None:
            raise ValueError("this decoder needs the model's mask token id")
        return self.mask_token_id


# A decoder's row opener (``DecoderSpec.open_row``): open row ``index`` of ``calls`` for ``prompt`` [P] and return
# its program; ``on_step`` sees the decoder's step records, ``clock`` keeps that time out of the row's latency.
# ``calls`` is the shared-calls object of the decoder's kind (``shared_calls``): an opener casts it to its class.
RowOpener = Callable[[ModelRunner, int, torch.Tensor, Any, RowOptions, "torch.Generator | None",
                      "Callable[[Any], None] | None", "RowClock | None"], RowProgram]


def ar_rows(calls: ModelRunner, index: int, prompt: torch.Tensor, config: Any, options: RowOptions,
            generator: torch.Generator | None, on_step: Callable[[Any], None] | None,
            clock: RowClock | None) -> RowProgram:
    """Autoregressive decoding (``ar.ar_program``); ``generator`` draws its tokens at temperature > 0."""
    return ar_row(cast(CausalRunner, calls), index, prompt, config, set(eos_ids(options.eos_token_id)), on_step, clock,
                  generator)


def refusion_rows(calls: ModelRunner, index: int, prompt: torch.Tensor, config: Any, options: RowOptions,
                  generator: torch.Generator | None, on_step: Callable[[Any], None] | None,
                  clock: RowClock | None) -> RowProgram:
    """ReFusion (``refusion.refusion_program``), in the variant ``options`` names."""
    causal_fix, causal_first, recheck = options.variant
    return refusion_row(cast(CausalRunner, calls), index, prompt, config, mask_token_id=options.mask_id,
                        eos_token_id=options.eos_token_id, generator=generator, causal_fix=causal_fix,
                        causal_first=causal_first, recheck=recheck, on_step=on_step, clock=clock)


def canvas_rows(program: Callable[[Canvas, Any, RowOptions, torch.Generator | None], CanvasStep[DecodeResult]]
                ) -> RowOpener:
    """The row opener of a masked-diffusion sampler whose canvas program is ``program(canvas, config, options,
    generator)``."""
    def open_canvas_row(calls: ModelRunner, index: int, prompt: torch.Tensor, config: Any, options: RowOptions,
                        generator: torch.Generator | None, on_step: Callable[[Any], None] | None,
                        clock: RowClock | None) -> RowProgram:
        return canvas_row(prompt, response_budget(config),
                          lambda canvas, row_generator: program(canvas, config, options, row_generator),
                          mask_token_id=options.mask_id, eos_token_id=options.eos_token_id,
                          generator=generator, on_step=on_step, clock=clock)
    return open_canvas_row


llada_rows = canvas_rows(lambda canvas, config, options, generator: llada_row(canvas, config, generator))
dream_rows = canvas_rows(lambda canvas, config, options, generator: dream_row(canvas, config, generator))
d2f_rows = canvas_rows(lambda canvas, config, options, generator: d2f_row(canvas, config, options.shifted, generator))


def commits(record: Any) -> list[Commit]:
    """What one ``on_step`` record committed, in commit order."""
    if isinstance(record, StepTrace):
        return [Commit(offset, token, kind) for offset, token, kind in
                zip(record.offsets, record.tokens, record.kinds, strict=True)]
    if isinstance(record, (ARStep, MDMStep)):
        kind = NEXT if isinstance(record, ARStep) else UNMASKED
        return [Commit(offset, token, kind) for offset, token in zip(record.offsets, record.tokens, strict=True)]
    raise TypeError(f"not a decoder step record: {type(record).__name__}")


__all__ = ["CANVAS", "CAUSAL", "NEXT", "UNMASKED", "Commit", "RowOpener", "RowOptions", "RowProgram", "ar_rows",
           "canvas_rows", "commits", "d2f_rows", "dream_rows", "llada_rows", "refusion_rows", "response_budget",
           "shared_calls"]
