"""Greedy autoregressive decoding with a KV cache: one token per forward (the AR baseline)."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.refusion import check_ids, prompt_tensor
from refusion_cli.decoding.stats import (DecodeResult, DecodeStats, EosIds, Timer, cache_argument,
                                         counted_forward, eos_ids, last_logits)


@torch.no_grad()
def decode_ar(
    model: torch.nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: EosIds,
) -> DecodeResult:
    """Greedy next-token decoding; stops after an EOS (any of the ids given) or ``max_new_tokens`` tokens."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    device = next(model.parameters()).device
    prompt = prompt_tensor(prompt_ids, device)
    check_ids(model, prompt, prompt.numel() + max_new_tokens, eos_token_id=eos_token_id)
    stops = set(eos_ids(eos_token_id))
    stats = DecodeStats()
    tokens: list[int] = []
    with Timer(device) as timer:
        cache = DynamicCache(config=model.config)
        next_input = prompt[None]  # [1, P] prefill, then [1, 1]
        for _ in range(max_new_tokens):
            out = counted_forward(model, stats, input_ids=next_input, use_cache=True,
                                  **cache_argument(model, cache), **last_logits(model, 1))
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if token in stops:
                break
            next_input = torch.tensor([[token]], device=device)
    stats.seconds = timer.seconds
    stats.tokens = len(tokens)
    return DecodeResult(tokens=tokens, stats=stats)
