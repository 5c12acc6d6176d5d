"""From a decoder's response ids to the text a task scores: which token ends a response, and how the
ids become text, under each protocol.

Contract: an :class:`AnswerRule` names the end ids a decoder is given (the response ends after the
first of them, that token included, as :class:`~refusion_cli.decoding.stats.DecodeResult` keeps it)
and turns those ids into the text lm-eval's filters receive. It knows a decoder only by its registry entry's
``answer_script`` and nothing of tasks;
the adapters apply it to every response, the parity tests to fixed ids.

- ``lm-eval``: stock lm-eval's ``hf`` model. The response ends at any end id of the checkpoint
  (``LoadedModel.stop_token_ids``: the tokenizer's EOS, then the generation config's, as
  ``generate`` stops); decoded without special tokens; cut at the earliest stop string.
- ``eval.py``: the paper's harness (ML-GSAI/ReFusion ``eval.py``, the ReFusion and AR rows). Its
  decoder stops only at the tokenizer's ``eos_token_id``, so any other end token (Qwen3's
  ``<|endoftext|>``) is an ordinary token; the ids are decoded *with* special tokens, split at each
  stop string in the task's order, re-tokenised (the tokenizer's normaliser applies: Qwen's NFC) and
  decoded *without* special tokens. Its last step (the first ```` ```python ```` block) is the first
  filter of every paper task (``paper_filters.python_blocks``).
- ``eval_llada.py``: LLaDA's own script (``eval_llada.py`` of ML-GSAI/LLaDA): the same text steps as
  ``eval.py``, without the python-block step of the model (the paper tasks' filter still applies).
- ``dream eval.py``: Dream's own script (``eval/eval.py`` of HKUNLP/Dream): decoded with special
  tokens, cut at the tokenizer's EOS *text*, then split at each stop string in order; no
  re-tokenisation, so another special token's text stays in the answer.

LLaDA's and Dream's scripts decode the whole canvas and never stop early; their rules here end the
response at the checkpoint's first end token, as the toolkit's decoders count tokens. The two give
the same text whenever only end and padding tokens follow the first end token; ordinary text after
an end token, which their scripts would keep, is dropped here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.models.loading import LoadedModel


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string (empty strings are ignored)."""
    cut = len(text)
    for stop in until:
        if stop:
            index = text.find(stop)
            if index != -1:
                cut = min(cut, index)
    return text[:cut]


def split_at_stops(text: str, until: list[str]) -> str:
    """The official scripts' cut: ``text.split(stop)[0]`` for each stop string in the task's order
    (an empty one, which ``split`` refuses, is skipped)."""
    for stop in until:
        if stop and stop in text:
            text = text.split(stop)[0]
    return text


def stock_text(tokenizer: Any, ids: list[int], until: list[str]) -> str:
    """lm-eval ``hf``: decoded without special tokens, cut at the earliest stop string."""
    return cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), until)


def retokenised_text(tokenizer: Any, ids: list[int], until: list[str]) -> str:
    """``eval.py`` / ``eval_llada.py``: decoded with special tokens, split at the stop strings, then
    re-tokenised and decoded without special tokens."""
    text = split_at_stops(tokenizer.decode(ids, skip_special_tokens=False), until)
    return tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)


def plain_split_text(tokenizer: Any, ids: list[int], until: list[str]) -> str:
    """D2F's ``eval_llada.py``: decoded without special tokens, then split at the stop strings."""
    return split_at_stops(tokenizer.decode(ids, skip_special_tokens=True), until)


def dream_text(tokenizer: Any, ids: list[int], until: list[str]) -> str:
    """Dream's ``eval.py``: decoded with special tokens, cut at the EOS token's text, split at the stops."""
    return split_at_stops(tokenizer.decode(ids, skip_special_tokens=False).split(tokenizer.eos_token)[0], until)


@dataclass(frozen=True)
class AnswerRule:
    """Which ids end a response and how its ids become the scored text."""

    name: str  # whose handling: "lm-eval", "eval.py", "eval_llada.py", "dream eval.py", "D2F eval_llada.py"
    eos_only: bool  # the response ends at the tokenizer's EOS only (else at every end id of the checkpoint)
    to_text: Callable[[Any, list[int], list[str]], str]

    def end_ids(self, loaded: LoadedModel) -> tuple[int, ...]:
        return (loaded.eos_token_id,) if self.eos_only else loaded.stop_token_ids

    def text(self, tokenizer: Any, ids: list[int], until: list[str]) -> str:
        return self.to_text(tokenizer, ids, until)


STOCK = AnswerRule("lm-eval", eos_only=False, to_text=stock_text)
EVAL_PY = AnswerRule("eval.py", eos_only=True, to_text=retokenised_text)
# --protocol paper: each evaluation script's answer handling, by the name a decoder's registry entry gives
# (``DecoderSpec.answer_script``); Fast-dLLM's scripts keep LLaDA's and Dream's text steps
SCRIPT_RULES = {rule.name: rule for rule in (
    EVAL_PY,
    AnswerRule("eval_llada.py", eos_only=False, to_text=retokenised_text),
    AnswerRule("dream eval.py", eos_only=False, to_text=dream_text),
    AnswerRule("D2F eval_llada.py", eos_only=False, to_text=plain_split_text),
)}


def answer_rule(decoder: str, protocol: EvalProtocol) -> AnswerRule:
    """The rule of ``decoder`` under ``protocol``: under ``paper`` its registry entry's script's."""
    if protocol == EvalProtocol.PAPER:
        return SCRIPT_RULES[decoder_spec(decoder).answer_script]
    return STOCK
