"""A response's text as an append-only stream, from commits that land in any order.

ReFusion commits slots out of order and the masked-diffusion samplers unmask positions anywhere in
their block, while an OpenAI stream can only append. :class:`PrefixText` keeps the committed tokens by
response offset and yields, after each step, the text of the committed *prefix* (offsets 0, 1, ...
up to the first one still open) that was not sent yet. Text is never rewritten: what could still
change is held back (a trailing incomplete UTF-8 character, a tail that may begin a stop string), and
:meth:`PrefixText.finish` sends the rest of the final answer, so the deltas joined are the answer.

The answer's text is the response's tokens decoded without special tokens and cut at the earliest stop
string (:func:`answer_text`, lm-eval's rule, which ``refusion eval`` applies by default); the response
ends at its first end id.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from refusion_cli.decoding.rows import Commit
from refusion_cli.harness.answers import cut_at_stop, stock_text

REPLACEMENT = "\ufffd"  # what a token boundary inside a UTF-8 character decodes to


def answer_text(tokenizer: Any, tokens: Sequence[int], stops: list[str]) -> str:
    return stock_text(tokenizer, list(tokens), stops)


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` may still change: an incomplete character, or the start
    of a stop string."""
    keep = len(text) - len(text.rstrip(REPLACEMENT))
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                keep = max(keep, size)
                break
    return keep


class PrefixText:
    def __init__(self, tokenizer: Any, end_ids: Iterable[int], stops: list[str]):
        self.tokenizer = tokenizer
        self.end_ids = set(end_ids)
        self.stops = stops
        self.by_offset: dict[int, int] = {}
        self.prefix: list[int] = []  # the committed prefix's tokens, before any end id
        self.ended = False  # an end id or a stop string closed the text
        self.sent = ""

    def add(self, commits: Iterable[Commit]) -> str:
        """Take a step's commits; the text to append now (may be empty)."""
        for commit in commits:
            self.by_offset[commit.offset] = commit.token
        if self.ended:
            return ""
        grown = False
        while len(self.prefix) in self.by_offset:
            token = self.by_offset[len(self.prefix)]
            if token in self.end_ids:
                self.ended = True
                break
            self.prefix.append(token)
            grown = True
        if not grown:
            return ""
        text = self.tokenizer.decode(self.prefix, skip_special_tokens=True)
        cut = cut_at_stop(text, self.stops)
        if len(cut) < len(text):
            self.ended = True
            text = cut
        else:
            text = text[: len(text) - held_back(text, self.stops)]
        return self._send(text)

    def finish(self, answer: str) -> str:
        """The rest of the final ``answer`` (empty when it was all sent)."""
        return self._send(answer)

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta


__all__ = ["PrefixText", "answer_text", "held_back"]
