"""Tiny checkpoint directories (random Qwen3 + the synthetic task's tokenizer) that load with load_model.

For tests of the command line, the harness and the benchmark: the code path is the one the
embedded models take, only the weights are random.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion_cli.tasks.synthetic import generate_problems
from refusion_cli.tasks.tokenizer import corpus_texts, train_tokenizer


def make_checkpoint(directory: Path, *, causal: bool = True, seed: int = 0, init_std: float = 0.3,
                    vocab_size: int = 512) -> Path:
    """Save a random tiny Qwen3 and a BPE tokenizer (Qwen3 special tokens, chat template) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_texts(generate_problems(200, seed=1)), vocab_size, directory)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, initializer_range=init_std,
        tie_word_embeddings=True, mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config.is_causal = causal
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory
