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
- ``reset()`` forgets the history; the config and the last stats are kept.
- Sampling noise (temperature > 0) comes from one ``torch.Generator`` seeded at creation, so a
  conversation replays identically.

Nothing here prints; the chat front end (``refusion_cli.chat.app``) owns the terminal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refusion_cli.decoding.registry import build_config, check_decoder_fits, run_decoder, with_length
from refusion_cli.decoding.stats import DecodeStats
from refusion_cli.models.chat import chat_prompt_ids
from refusion_cli.models.loading import LoadedModel


def chat_config(decoder: str, overrides: dict[str, Any]) -> Any:
    """The decoder config a chat starts with: the defaults, what follows --set gen_length, then --set."""
    return build_config(decoder, with_length(decoder, overrides))


@dataclass
class ChatAnswer:
    text: str  # the decoded answer, special tokens dropped
    tokens: list[int]  # response ids (position order, up to and including EOS)
    stats: DecodeStats
    prompt_tokens: int  # length of the rendered conversation the answer was decoded after


class ChatSession:
    def __init__(self, loaded: LoadedModel, decoder: str = "refusion", overrides: dict[str, Any] | None = None,
                 *, model_name: str = "", seed: int = 0, force: bool = False, keep_history: bool = True):
        check_decoder_fits(decoder, loaded.bidirectional, force=force)
        self.keep_history = keep_history  # False: every question is asked on its own
        self.loaded = loaded
        self.decoder = decoder
        self.model_name = model_name or loaded.source
        self.explicit = set(overrides or {})  # settings the user gave; the others may follow gen_length
        self.config = chat_config(decoder, overrides or {})
        self.history: list[dict[str, str]] = []
        self.last: ChatAnswer | None = None
        self.generator = torch.Generator(device=next(loaded.model.parameters()).device).manual_seed(seed)

    @property
    def turns(self) -> int:
        """Answered questions in the current conversation."""
        return len(self.history) // 2

    def ask(self, question: str, on_step: Callable[[Any], None] | None = None) -> ChatAnswer:
        messages = [*self.history, {"role": "user", "content": question}]
        prompt_ids = chat_prompt_ids(self.loaded.tokenizer, messages)
        result = run_decoder(self.decoder, self.loaded.model, prompt_ids, self.config,
                             mask_token_id=self.loaded.mask_token_id, eos_token_id=self.loaded.stop_token_ids,
                             generator=self.generator, on_step=on_step)
        text = self.loaded.tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
        answer = ChatAnswer(text, result.tokens, result.stats, len(prompt_ids))
        if self.keep_history:
            self.history = [*messages, {"role": "assistant", "content": text}]
        self.last = answer
        return answer

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
        self.history = []
