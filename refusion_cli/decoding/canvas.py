"""The canvas a masked-diffusion sampler (LLaDA, Dream, D2F) denoises: the prompt followed by masks, on the
device, with a host copy of the response that follows every unmasking.

A sampler never reads the canvas back: it chooses on the device, writes the chosen tokens with
:meth:`Canvas.write` (a fixed-shape write, no wait) and learns what it wrote from one readback of the step
(``decoding.readback``: :meth:`Canvas.unmask` is write + read + record), which updates the host copy; the
host copy answers "which positions are still masked" and makes the result. Token ids only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generator, TypeVar

import torch

from refusion_cli.decoding.readback import read, to_device
from refusion_cli.decoding.stats import DecodeResult, DecodeStats, EosIds, RowClock, cut_after_eos

T = TypeVar("T")
# a row program's step: yields feeds (sent their replies) or readbacks (sent host values), returns T
CanvasStep = Generator[Any, Any, T]


@dataclass
class MDMStep:
    """What one step of a masked-diffusion sampler unmasked (offsets count from the response start)."""

    block: int
    step: int  # step within the block, from 0
    offsets: list[int] = field(default_factory=list)  # response offsets unmasked by this step, in choice order
    tokens: list[int] = field(default_factory=list)  # the tokens written there


@dataclass(frozen=True)
class Block:
    index: int
    start: int  # first canvas position of the block
    end: int  # one past its last canvas position

    @property
    def length(self) -> int:
        return self.end - self.start


def even_schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to unmask at each of ``steps`` steps: n // steps each, the remainder on the first steps."""
    base, remainder = divmod(n_masked, steps)
    return [base + 1 if step < remainder else base for step in range(steps)]


@dataclass(frozen=True)
class Written:
    """A write of :meth:`Canvas.write` the host has not seen yet: block offsets [k], tokens [k], and which of
    them were taken ([k] bool, None: all)."""

    block: Block
    offsets: torch.Tensor
    tokens: torch.Tensor
    taken: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.offsets, self.tokens) if self.taken is None else (self.offsets, self.tokens, self.taken)


class Canvas:
    """The sequence being denoised (prompt + masked response) on the device, its host copy, counters and trace."""

    def __init__(self, prompt: torch.Tensor, gen_length: int, *, mask_token_id: int, eos_token_id: EosIds,
                 report: Callable[[DecodeStats, MDMStep], None] | None = None):
        self.device = prompt.device
        self.prompt_length = prompt.numel()
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id
        masks = torch.full((gen_length,), mask_token_id, dtype=torch.long, device=self.device)
        self.ids = torch.cat([prompt, masks])  # [P + L]
        self.response = [mask_token_id] * gen_length  # host copy of ids[P:]
        self.stats = DecodeStats()
        self.trace: list[MDMStep] = []
        self.report = report

    @property
    def length(self) -> int:
        return self.prompt_length + len(self.response)

    def blocks(self, block_length: int) -> Iterator[Block]:
        """The response's blocks, left to right."""
        for index, start in enumerate(range(self.prompt_length, self.length, block_length)):
            yield Block(index, start, min(start + block_length, self.length))

    def masked_offsets(self, block: Block) -> list[int]:
        """The block offsets that still hold the mask token, ascending (from the host copy)."""
        first = block.start - self.prompt_length
        return [offset for offset in range(block.length) if self.response[first + offset] == self.mask_token_id]

    def mask_count(self, block: Block) -> int:
        return len(self.masked_offsets(block))

    def steps(self, block: Block, steps: int, threshold: float | None, cached: bool) -> Iterator[int]:
        """Step indices for ``block``. Without the cache: exactly ``steps`` of them, or, with a threshold,
        until no mask is left. With the cache: until no mask is left, and at least two, since the
        block's full pass is always followed by a cached step (which finds nothing left to unmask when
        the full pass finished the block)."""
        step = 0
        while self._takes_another_step(block, step, steps, threshold, cached):
            yield step
            step += 1

    def _takes_another_step(self, block: Block, step: int, steps: int, threshold: float | None, cached: bool) -> bool:
        if cached:
            return step < 2 or self.mask_count(block) > 0
        if threshold is None:
            return step < steps
        return self.mask_count(block) > 0

    def write(self, block: Block, offsets: torch.Tensor, tokens: torch.Tensor,
              taken: torch.Tensor | None = None) -> Written:
        """Write ``tokens`` [k] at block offsets ``offsets`` [k] (distinct) on the device, those ``taken`` [k]
        only when given; the host learns of it from :meth:`record`."""
        positions = block.start + offsets
        self.ids[positions] = tokens if taken is None else torch.where(taken, tokens, self.ids[positions])
        return Written(block, offsets, tokens, taken)

    def record(self, written: Written, step: int, values: tuple[list, ...]) -> list[int]:
        """The host copy and the trace after ``written``, from its read-back ``values``; returns the tokens."""
        offsets, tokens = values[0], values[1]
        if written.taken is not None:
            offsets, tokens = ([value for value, kept in zip(column, values[2]) if kept] for column in (offsets, tokens))
        return self._recorded(written.block, step, offsets, tokens)

    def commit(self, block: Block, step: int, offsets: list[int], tokens: list[int]) -> list[int]:
        """Write ``tokens`` at block ``offsets`` (host values, distinct) on the device, one copy and one write,
        and record them as :meth:`record` does; returns the tokens."""
        return self.commit_blocks(step, [(block, offsets, tokens)])[0]

    def commit_blocks(self, step: int, commits: list[tuple[Block, list[int], list[int]]]) -> list[list[int]]:
        """:meth:`commit` of several blocks' (block, offsets, tokens), one copy and one write for all of them, each
        recorded in turn; returns each one's tokens."""
        positions = [block.start + offset for block, offsets, _ in commits for offset in offsets]
        if positions:
            places = to_device(torch.tensor([positions, [token for *_, tokens in commits for token in tokens]]),
                               self.device)
            self.ids[places[0]] = places[1]
        return [self._recorded(block, step, offsets, tokens) for block, offsets, tokens in commits]

    def _recorded(self, block: Block, step: int, offsets: list[int], tokens: list[int]) -> list[int]:
        first = block.start - self.prompt_length
        for offset, token in zip(offsets, tokens):
            self.response[first + offset] = token
        record = MDMStep(block.index, step, [first + offset for offset in offsets], tokens)
        self.trace.append(record)
        if self.report is not None:
            self.report(self.stats, record)
        return tokens

    def unmask(self, block: Block, step: int, offsets: torch.Tensor, tokens: torch.Tensor,
               taken: torch.Tensor | None = None) -> CanvasStep[list[int]]:
        """:meth:`write`, one readback, :meth:`record` (none when nothing is written); returns the tokens."""
        written = self.write(block, offsets, tokens, taken)
        values = (yield from read(*written.tensors())) if offsets.numel() else ([], [], [])
        return self.record(written, step, values)

    def result(self) -> DecodeResult:
        """The response cut after its first EOS, with the shared counters (``seconds`` is set by the driver)."""
        tokens = cut_after_eos(list(self.response), self.eos_token_id)
        self.stats.tokens = len(tokens)
        return DecodeResult(tokens=tokens, stats=self.stats, trace=self.trace)


def report_to(clock: RowClock, callback: Callable[[MDMStep], None], stats: DecodeStats, record: MDMStep) -> None:
    """Hand a row's step to the caller's callback through the batch's clock."""
    clock.report(stats, callback, record)


__all__ = ["Block", "Canvas", "CanvasStep", "MDMStep", "Written", "even_schedule", "report_to"]
