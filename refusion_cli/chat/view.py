"""The live view of an answer being decoded: slots filling out of order.

:class:`SlotCanvas` keeps, for every response position, the committed token's text piece (each
token decoded on its own, by position) and the iteration that committed it. Its rendering shows
the positions from the first to the furthest committed one: committed pieces coloured by their
iteration (the newest in bold), still-masked positions as ``░``. It takes any per-step record
with ``offsets`` and ``tokens`` (ReFusion's ``StepTrace``, LLaDA / Dream's ``MDMStep``).

:class:`LiveAnswer` shows the canvas in a transient ``rich.live.Live`` while the decoder runs;
disabled (stdout not a terminal) it only keeps the canvas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

MASKED = "░"
PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta", "bright_green")


class SlotCanvas:
    def __init__(self, piece: Callable[[int], str]):
        self.piece = piece  # token id -> its text on its own
        self.pieces: dict[int, str] = {}  # response offset -> text piece
        self.iteration_of: dict[int, int] = {}  # response offset -> the iteration that committed it
        self.iterations = 0

    def add(self, step: Any) -> None:
        """Record one iteration's committed tokens (``step.offsets``, ``step.tokens``)."""
        for offset, token in zip(step.offsets, step.tokens, strict=True):
            self.pieces[offset] = self.piece(token)
            self.iteration_of[offset] = self.iterations
        self.iterations += 1

    def render(self) -> Text:
        text = Text()
        if not self.pieces:
            return Text(MASKED * 8, style="dim")
        newest = self.iterations - 1
        for offset in range(max(self.pieces) + 1):
            if offset not in self.pieces:
                text.append(MASKED, style="dim")
                continue
            iteration = self.iteration_of[offset]
            style = PALETTE[iteration % len(PALETTE)] + (" bold" if iteration == newest else "")
            text.append(self.pieces[offset], style=style)
        return text


class LiveAnswer:
    """``with LiveAnswer(console, piece, enabled) as view: decode(on_step=view.on_step)``."""

    def __init__(self, console: Console, piece: Callable[[int], str], enabled: bool = True):
        self.canvas = SlotCanvas(piece)
        self.live = Live(self.canvas.render(), console=console, transient=True, refresh_per_second=15) \
            if enabled else None

    def on_step(self, step: Any) -> None:
        self.canvas.add(step)
        if self.live is not None:
            self.live.update(self.canvas.render(), refresh=True)  # draw every step, however fast the decode

    def __enter__(self) -> LiveAnswer:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            # Live.stop() draws its renderable once more uncropped, then erases it: the lines of a canvas
            # taller than the terminal would scroll out of reach and stay. Stop on an empty view instead.
            self.live.update(Text(""), refresh=False)
            self.live.stop()


class PieceCache:
    """Token id -> its text decoded on its own (special tokens dropped), computed once per id."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token], skip_special_tokens=True)
        return self.cache[token]
