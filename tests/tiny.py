"""Tiny randomly initialised Qwen3 models for fast, exact CPU tests."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 64
MASK_ID = 63  # the last id plays <|mask|>
EOS_ID = 62
PAD_ID = 0  # what the training tests pad their batches with


def tiny_qwen3(seed: int = 0, *, causal: bool = True, dtype: torch.dtype = torch.float64, vocab: int = VOCAB,
               init_std: float = 0.02, layers: int = 2, max_positions: int = 1024) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 with a 64-token vocabulary; ``init_std`` > 0.02 gives peakier, more varied logits."""
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
        initializer_range=init_std, tie_word_embeddings=False, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
    )
    config.is_causal = causal
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    return model.requires_grad_(False)
