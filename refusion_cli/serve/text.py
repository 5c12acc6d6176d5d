"""A response's text: detokenized incrementally, cut at stop strings, streamed append-only from commits
that land in any order.

ReFusion commits slots out of order and the masked-diffusion samplers unmask positions anywhere in
their block, while an OpenAI stream can only append. Only the committed *prefix* (offsets 0, 1, ... up
to the first one still open) is text a client may show as final.

- :class:`Detokenizer`: token ids in, one at a time, text out; each token decodes a window of a few
  tokens (vLLM's ``detokenize_incrementally``), so a response costs time linear in its length.
- :class:`TextRules`: what a request asks of its text (stop strings, ``include_stop_str_in_output``,
  ``skip_special_tokens``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, the ``max_tokens`` cap).
- :class:`StopWatch`: the job's stop rule (``serve.engine.Job.stop``), run on the scheduler thread after
  each decoder step with the committed prefix: it ends the row at the token that completes a stop string
  or is an end id, so the compute is saved, not only the text cut.
- :class:`PrefixText`: the streamed deltas; what could still change is held back (a trailing incomplete
  UTF-8 character, a tail that may begin a stop string) and :meth:`PrefixText.finish` sends the rest of
  the final answer, so the deltas joined are the answer.
- :func:`answer_text`: the answer of a finished response's tokens.

A tokenizer is called from one thread only: nothing here calls it when made, so the HTTP side makes these
objects on its event loop and hands :class:`StopWatch` the scheduler's own copy of the tokenizer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from refusion_cli.decoding.rows import Commit

REPLACEMENT = "\ufffd"  # what a token boundary inside a UTF-8 character decodes to


@dataclass(frozen=True)
class TextRules:
    """What one request asks of its text and of where its response ends."""

    end_ids: frozenset[int]  # the model's end ids: a response ends at the first one (unless ignore_eos)
    stops: tuple[str, ...] = ()
    include_stop: bool = False  # include_stop_str_in_output: keep the stop string in the text
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # the response runs to max_tokens; end ids are text like any token
    min_tokens: int = 0  # no end id, stop id or stop string ends the response before this many tokens
    stop_token_ids: frozenset[int] = frozenset()  # more ids that end the response (vLLM's stop_token_ids)
    max_tokens: int | None = None  # cut the response here (a decoder whose budget is rounded up: ReFusion's slots)

    def ends(self, token: int, offset: int) -> bool:
        """Whether ``token`` at response ``offset`` ends the response."""
        if offset < self.min_tokens:
            return False
        return token in self.stop_token_ids or (not self.ignore_eos and token in self.end_ids)

    @property
    def needs_rule(self) -> bool:
        """Whether the scheduler must watch the committed prefix (else the decoder's own end is the end)."""
        return bool(self.stops or self.min_tokens or self.stop_token_ids or self.ignore_eos
                    or self.max_tokens is not None)

    def stop_at(self, text: str, after: int = 0) -> tuple[int, int] | None:
        """The earliest stop string in ``text`` that ends past character ``after``: (its start, its end)."""
        found = None
        for stop in self.stops:
            index = text.find(stop, max(0, after - len(stop) + 1))
            if index != -1 and (found is None or index < found[0]):
                found = (index, index + len(stop))
        return found

    def cut(self, text: str, stop: tuple[int, int]) -> str:
        return text[: stop[1] if self.include_stop else stop[0]]


class Detokenizer:
    """Text of a growing list of token ids, one decode of a short window per token; the text is kept in
    pieces, so reading its tail costs the tail's length, not the text's."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []  # the tokens that carry text (special ones dropped when skipped)
        self.prefix_offset = 0  # the window's start: tokens before it are text for good
        self.read_offset = 0  # tokens before it are in the text
        self.pieces: list[str] = []
        self.length = 0  # characters of text

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @functools.cached_property
    def special(self) -> frozenset[int]:
        """The ids that carry no text: read at the first token, on the thread that calls the tokenizer."""
        return frozenset(self.tokenizer.all_special_ids) if self.skip_special_tokens else frozenset()

    def push(self, token: int) -> str:
        """Add one token; the text it completes (empty while a character is still cut)."""
        if token in self.special:
            return ""
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # an incomplete UTF-8 character: wait for the next token
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.pieces.append(delta)
        self.length += len(delta)
        return delta

    def tail(self, size: int) -> str:
        """The last ``size`` characters of the text."""
        if size <= 0:
            return ""
        taken, count = [], 0
        for piece in reversed(self.pieces):
            taken.append(piece)
            count += len(piece)
            if count >= size:
                break
        return "".join(reversed(taken))[-size:]


class StopWatch:
    """The stop rule of one job: called with the committed prefix after each step, it reads only the new
    tokens and returns how many tokens to keep once the response ends (else None). ``reason`` says why
    (``stop``: an end or stop id, a stop string; ``length``: the ``max_tokens`` cap)."""

    def __init__(self, tokenizer: Any, rules: TextRules):
        self.rules = rules
        self.text = Detokenizer(tokenizer, rules.skip_special_tokens) if rules.stops else None
        self.longest = max((len(stop) for stop in rules.stops), default=0)
        self.seen = 0  # prefix tokens read
        self.kept: int | None = None
        self.reason: str | None = None

    def __call__(self, prefix: list[int]) -> int | None:
        if self.kept is not None:
            return self.kept
        rules = self.rules
        for offset in range(self.seen, len(prefix)):
            self.seen = offset + 1
            if rules.max_tokens is not None and offset >= rules.max_tokens:
                return self._end(rules.max_tokens, "length")
            token = prefix[offset]
            if rules.ends(token, offset):
                return self._end(offset + 1, "stop")
            if self.text is not None:
                delta = self.text.push(token)
                if delta and offset + 1 >= rules.min_tokens:
                    window = self.text.tail(self.longest - 1 + len(delta))
                    if rules.stop_at(window, len(window) - len(delta)) is not None:  # a stop ending in the delta
                        return self._end(offset + 1, "stop")
        if rules.max_tokens is not None and len(prefix) >= rules.max_tokens:
            return self._end(rules.max_tokens, "length")
        return None

    def _end(self, kept: int, reason: str) -> int:
        self.kept, self.reason = kept, reason
        return kept


def text_ids(tokens: Sequence[int], rules: TextRules) -> list[int]:
    """The tokens whose text is the answer: all but a final end id (its text is never shown)."""
    ids = list(tokens)
    if ids and rules.ends(ids[-1], len(ids) - 1):
        ids.pop()
    return ids


def answer_text(tokenizer: Any, tokens: Sequence[int], rules: TextRules) -> str:
    """The answer of a finished response: its text, cut at the earliest stop string that ends in the text
    of token ``min_tokens`` or later (vLLM checks no stop before ``min_tokens``)."""
    ids = text_ids(tokens, rules)
    text = tokenizer.decode(ids, skip_special_tokens=rules.skip_special_tokens)
    after = 0
    if rules.stops and rules.min_tokens > 1:
        after = len(tokenizer.decode(ids[: rules.min_tokens - 1], skip_special_tokens=rules.skip_special_tokens))
    stop = rules.stop_at(text, after)
    return text if stop is None else rules.cut(text, stop)


def held_back(text: str, stops: Iterable[str]) -> int:
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
    """The streamed text of one response, from its commits."""

    def __init__(self, tokenizer: Any, rules: TextRules):
        self.rules = rules
        self.detokenizer = Detokenizer(tokenizer, rules.skip_special_tokens)
        self.longest = max((len(stop) for stop in rules.stops), default=0)
        self.by_offset: dict[int, int] = {}
        self.length = 0  # the committed prefix's length so far
        self.checked_from = 0  # a stop string counts once it ends past this character (min_tokens)
        self.ended = False  # an end id or a stop string closed the text
        self.parts: list[str] = []  # the deltas sent
        self.sent_length = 0

    @property
    def sent(self) -> str:
        return "".join(self.parts)

    def add(self, commits: Iterable[Commit]) -> str:
        """Take a step's commits; the text to append now (may be empty)."""
        for commit in commits:
            self.by_offset[commit.offset] = commit.token
        if self.ended:
            return ""
        detokenizer, rules = self.detokenizer, self.rules
        searched = detokenizer.length
        while self.length in self.by_offset:
            token = self.by_offset.pop(self.length)
            if rules.ends(token, self.length) or (rules.max_tokens is not None and self.length >= rules.max_tokens):
                self.ended = True
                break
            if self.length + 1 == rules.min_tokens:
                self.checked_from = detokenizer.length
            detokenizer.push(token)
            self.length += 1
        total = detokenizer.length
        end = total
        stop = None
        if rules.stops and self.length >= rules.min_tokens:
            after = max(searched, self.checked_from)
            window = detokenizer.tail(total - after + self.longest - 1)
            stop = rules.stop_at(window, len(window) - (total - after))
            if stop is not None:
                self.ended = True
                end = total - len(window) + (stop[1] if rules.include_stop else stop[0])
        if stop is None and not self.ended:
            end -= held_back(detokenizer.tail(self.longest), rules.stops)
        if end <= self.sent_length:
            return ""
        return self._send(detokenizer.tail(total - self.sent_length)[: end - self.sent_length])

    def finish(self, answer: str) -> str:
        """The rest of the final ``answer`` (empty when it was all sent)."""
        if not answer.startswith(self.sent) or len(answer) <= self.sent_length:
            return ""
        return self._send(answer[self.sent_length:])

    def _send(self, delta: str) -> str:
        self.parts.append(delta)
        self.sent_length += len(delta)
        return delta


__all__ = ["Detokenizer", "PrefixText", "StopWatch", "TextRules", "answer_text", "held_back", "text_ids"]
