"""One conversation with one model and one decoder: the history, the decoder config, the last stats.

Contract of :class:`ChatSession`:

- ``ask(question, on_step=...)`` renders the whole history plus the new user turn with the
  model's chat template, decodes the answer with the session's decoder (``run_decoder``, batch 1;
  ``on_step`` sees every iteration; an exception raised from it aborts the decode), and returns a
  :class:`ChatAnswer`. The two turns join the history only when the decode finished: an
  interrupted or failed answer leaves the conversation as it was.
- ``set_option(name, value)`` rebuilds the config through ``build_config`` (the value may be a
  string); a refused value raises :class:`UserError` and nothing changes. A new ``gen_length``
  (here or in the starting overrides) also moves LLaDA's / Dream's ``steps`` and LLaDA's
  ``block_length`` as bench and eval set them (``registry.length_settings``), unless the user set
  those.
- ``system`` (at creation, or ``set_system``) is the system message every prompt starts with,
  rendered by the same template as the turns; setting it starts a new conversation. A template
  that cannot render it (raises) is a :class:`UserError` and nothing changes.
- ``reset()`` forgets the history; the system message, the config and the last stats are kept.
- ``transcript()`` is the conversation so far as JSON-ready data (what ``/save`` writes): every
  answered question since the last reset, with or without history (``"history"`` says which).
- ``variant`` (ReFusion only, ``decoding.variants``) decodes with the toolkit's variants instead of the
  paper's decoder; ``label`` names the decoder and its variant, ``transcript()`` records it.
- Sampling noise (temperature > 0) comes from one ``torch.Generator`` seeded at creation, so a
  conversation replays identically.

Nothing here prints; the chat front end (``refusion_cli.chat.app``) owns the terminal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import TemplateError

from refusion_cli.decoding.registry import build_config, check_decoder_fits, with_length
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.spec import PRESET_DECODER, DecoderChoice
from refusion_cli.decoding.stats import DecodeResult, DecodeStats
from refusion_cli.decoding.variants import PAPER, Variant, variant_label, variant_options
from refusion_cli.errors import UserError
from refusion_cli.models.chat import chat_prompt_ids
from refusion_cli.models.loading import LoadedModel


SYSTEM_PROBE = "?"  # the user turn rendered after a new system message, to see that the template takes it


def chat_config(decoder: str, overrides: Mapping[str, Any], preset: str | None = None, model: str | None = None) -> Any:
    """The decoder config a chat starts with: the preset, else the model's own (ReFusion on refusion-tiny), else the
    defaults, what follows --set gen_length, then --set (:class:`~refusion_cli.decoding.spec.DecoderChoice`, as
    eval, bench and serve build theirs)."""
    return DecoderChoice(decoder, model, preset, dict(overrides)).config()


@dataclass
class ChatAnswer:
    text: str  # the decoded answer, special tokens dropped
    tokens: list[int]  # response ids (position order, up to and including EOS)
    stats: DecodeStats
    prompt_tokens: int  # length of the rendered conversation the answer was decoded after


class ChatSession:
    def __init__(self, loaded: LoadedModel, decoder: str = PRESET_DECODER, overrides: dict[str, Any] | None = None,
                 *, model_name: str = "", seed: int = 0, force: bool = False, keep_history: bool = True,
                 system: str | None = None, preset: str | None = None, variant: Variant = PAPER):
        check_decoder_fits(decoder, loaded.bidirectional, force=force, shifted=loaded.shifted)
        self.keep_history = keep_history  # False: every question is asked on its own
        self.loaded = loaded
        self.decoder = decoder
        self.variant = variant  # ReFusion's decoding variant (decoding.variants); PAPER for every other decoder
        self.label = variant_label(decoder, variant)  # "refusion", "refusion (recheck)", "ar", ...
        self.model_name = model_name or loaded.source
        self.explicit = set(overrides or {})  # settings the user gave; the others may follow gen_length
        self.config = chat_config(decoder, overrides or {}, preset, self.model_name)
        self.system: str | None = None
        self.exchanges: list[tuple[str, ChatAnswer]] = []  # (question, answer) since the last reset, in order
        self.last: ChatAnswer | None = None
        self.seed = seed
        self.generator = torch.Generator(device=next(loaded.model.parameters()).device).manual_seed(seed)
        self.set_system(system)

    @property
    def history(self) -> list[dict[str, str]]:
        """The turns the next prompt carries after the system message (none without history)."""
        return turn_messages(self.exchanges) if self.keep_history else []

    @property
    def turns(self) -> int:
        """Answered questions in the current conversation."""
        return len(self.history) // 2

    def messages(self, question: str) -> list[dict[str, str]]:
        """What the prompt for ``question`` renders: the system message, the history, the question."""
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, *self.history, {"role": "user", "content": question}]

    def prompt_ids(self, question: str) -> list[int]:
        """The prompt for ``question`` as the model's chat template renders it (the only place that renders)."""
        return self._render(self.messages(question), what="this conversation")

    def ask(self, question: str, on_step: Callable[[Any], None] | None = None) -> ChatAnswer:
        prompt_ids = self.prompt_ids(question)
        result = run_decoder(self.decoder, self.loaded.model, prompt_ids, self.config,
                             mask_token_id=self.loaded.mask_token_id, eos_token_id=self.loaded.stop_token_ids,
                             generator=self.generator, on_step=on_step, **variant_options(self.variant))
        assert isinstance(result, DecodeResult), "one prompt decodes to one result"
        text = self.loaded.tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
        answer = ChatAnswer(text, result.tokens, result.stats, len(prompt_ids))
        self.exchanges.append((question, answer))
        self.last = answer
        return answer

    def set_system(self, system: str | None) -> None:
        """Start a new conversation under ``system`` (None: without a system message). A template that
        cannot render a system message raises :class:`UserError` and nothing changes."""
        if system is not None:
            self._render([{"role": "system", "content": system}, {"role": "user", "content": SYSTEM_PROBE}],
                         what="a system message")
        self.system = system
        self.exchanges = []

    def _render(self, messages: list[dict[str, str]], what: str) -> list[int]:
        """``chat_prompt_ids``; a template that raises (e.g. on a role it does not take) is a :class:`UserError`."""
        try:
            return chat_prompt_ids(self.loaded.tokenizer, messages)
        except TemplateError as exc:
            raise UserError(f"the chat template of {self.model_name} cannot render {what}: {exc}") from exc

    def set_option(self, name: str, value: str) -> Any:
        """Change one decoder option (validated); returns the new config. A new ``gen_length`` also
        moves the settings that follow it (``registry.length_settings``) unless they were set."""
        self.config = build_config(self.decoder, with_length(self.decoder, {name: value}, self.explicit),
                                   base=self.config)
        self.explicit.add(name)
        return self.config

    def options(self) -> dict[str, Any]:
        """The decoder config as name -> value."""
        return dataclasses.asdict(self.config)

    def reset(self) -> None:
        """A new conversation under the same system message."""
        self.exchanges = []

    def transcript(self) -> dict[str, Any]:
        """The conversation so far as JSON-ready data: what ``/save`` and ``--save`` write."""
        return {
            "model": self.model_name,
            "decoder": self.decoder,
            **({"variant": variant_options(self.variant)} if any(self.variant) else {}),
            "config": self.options(),  # the settings in use now (``/set`` may have changed them between answers)
            "seed": self.seed,
            "history": self.keep_history,  # False: each question was asked on its own
            "system": self.system,
            "messages": turn_messages(self.exchanges),
            "stats": [answer_stats(answer) for _, answer in self.exchanges],  # one per assistant message
        }


def turn_messages(exchanges: list[tuple[str, ChatAnswer]]) -> list[dict[str, str]]:
    """(question, answer) pairs as alternating user and assistant messages."""
    return [message for question, answer in exchanges
            for message in ({"role": "user", "content": question}, {"role": "assistant", "content": answer.text})]


def answer_stats(answer: ChatAnswer) -> dict[str, float | int]:
    stats = answer.stats
    return {"tokens": stats.tokens, "tps": stats.tps, "tpf": stats.tpf, "forwards": stats.forwards,
            "seconds": stats.seconds, "prompt_tokens": answer.prompt_tokens}
