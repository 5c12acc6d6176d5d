"""A scripted stand-in for a causal LM whose probabilities each test sets by hand.

The response the model "wants" is ``truth`` (by response offset). For every fed token it returns a
distribution with one likely token:

- a mask at offset q drafts ``truth[q]`` with probability ``plan.get(q, 0.99)``; ``wrong`` can
  make a given call draft another token instead (``{call: {offset: token}}``);
- a real token at offset q (prompt offsets are negative) predicts ``truth[q + 1]`` with
  probability ``ar.get(q + 1, 0.99)``.

Everything else shares the remaining mass, so a drafted token that is not the truth gets a tiny
AR probability. Each call is recorded (fed tokens and positions) for the test to inspect.

:class:`FixedRowsModel` is the same for the MDM decoders (LLaDA, Dream): a bidirectional stand-in whose
logits at each canvas position are a row the test gives (:func:`log_probs` writes one from probabilities).
"""

from __future__ import annotations

import math

import torch
from transformers import Qwen3Config

VOCAB = 16
MASK = 15
EOS = 14


class ScriptedModel(torch.nn.Module):
    def __init__(self, prompt_len: int, truth: list[int], plan: dict[int, float] | None = None,
                 ar: dict[int, float] | None = None, wrong: dict[int, dict[int, int]] | None = None):
        super().__init__()
        self.config = Qwen3Config(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=256)
        self.embed = torch.nn.Embedding(VOCAB, 1)  # only for the vocabulary size and device
        self.prompt_len = prompt_len
        self.truth = truth
        self.plan = plan or {}
        self.ar = ar or {}
        self.wrong = wrong or {}
        self.calls: list[tuple[list[int], list[int]]] = []

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def _distribution(self, token: int, p: float) -> list[float]:
        rest = (1.0 - p) / (VOCAB - 1)
        return [math.log(p) if t == token else math.log(rest) for t in range(VOCAB)]

    def forward(self, input_ids, position_ids, **_ignored):
        ids, positions = input_ids[0].tolist(), position_ids[0].tolist()
        call = len(self.calls)
        self.calls.append((ids, positions))
        rows = []
        for token, position in zip(ids, positions):
            offset = position - self.prompt_len
            if token == MASK:
                drafted = self.wrong.get(call, {}).get(offset, self.truth[offset])
                rows.append(self._distribution(drafted, self.plan.get(offset, 0.99)))
            elif offset + 1 < 0:  # inside the prompt: nothing to script
                rows.append(self._distribution(1, 0.5))
            elif offset + 1 < len(self.truth):
                rows.append(self._distribution(self.truth[offset + 1], self.ar.get(offset + 1, 0.99)))
            else:
                rows.append(self._distribution(EOS, 0.99))
        logits = torch.tensor([rows], dtype=torch.float64)
        return type("Output", (), {"logits": logits, "cache": None})()


class FixedRowsModel(torch.nn.Module):
    """A bidirectional stand-in whose logits at canvas position p are always ``rows[p]`` (``default`` elsewhere)."""

    def __init__(self, rows: dict[int, list[float]], default: list[float], dtype: torch.dtype = torch.float64):
        super().__init__()
        self.rows, self.default = rows, default
        self.embed = torch.nn.Embedding(len(default), 1).to(dtype)  # the vocabulary size, device and dtype
        self.config = type("Config", (), {"is_causal": False, "max_position_embeddings": 64})()

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor, **_ignored):
        rows = [self.rows.get(p, self.default) for p in range(input_ids.shape[1])]
        return type("Output", (), {"logits": torch.tensor([rows], dtype=self.embed.weight.dtype)})()


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]
