"""The model computes the logits a sampler reads, and no others.

With a vocabulary of 126k-152k words the logits of a whole canvas (prompt + 512 positions) cost
more memory than the rest of a call; LLaDA reads its block's, Dream and D2F their masks' (shifted:
the position before each). Each call's logits are counted here against what the sampler could read.
"""

from __future__ import annotations

import pytest
import torch

from refusion_cli.decoding import D2FConfig, DreamConfig, LLaDAConfig, run_decoder
from refusion_cli.decoding.stats import kept_logits, logits_at
from tests.tiny import MASK_ID


@pytest.fixture
def calls(bidirectional_model):
    """Every call of the bidirectional model: (fed ids [B, Q], rows of logits it returned)."""
    seen: list[tuple[torch.Tensor, int]] = []

    def hook(module, args, kwargs, out):
        seen.append((kwargs["input_ids"].clone(), out.logits.shape[1]))

    handle = bidirectional_model.register_forward_hook(hook, with_kwargs=True)
    yield seen
    handle.remove()


PROMPT = [5, 17, 3, 40, 22, 9, 11, 30, 2]  # 9 tokens: a canvas of 9 + 16


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_llada_computes_the_block_only(bidirectional_model, calls, cache):
    config = LLaDAConfig(gen_length=16, steps=8, block_length=8, use_cache=cache is not None,
                         dual_cache=cache == "dual", cfg_scale=1.0 if cache is None else 0.0)
    run_decoder("llada", bidirectional_model, PROMPT, config, mask_token_id=MASK_ID, eos_token_id=None)
    assert {rows for _, rows in calls} == {8}  # a block, whatever the call fed (25, 17 or 8 positions)
    assert max(ids.shape[1] for ids, _ in calls) == len(PROMPT) + 16


@pytest.mark.parametrize("config", [
    DreamConfig(gen_length=16, steps=4, temperature=0.0, top_p=None),
    DreamConfig(gen_length=16, steps=16, alg="origin", temperature=1.0, top_p=0.9),
    DreamConfig(gen_length=16, steps=8, block_length=8, threshold=0.3, use_cache=True, alg="maskgit_plus",
                temperature=0.0, top_p=None),
    # one step a block: the full pass takes every mask, the cached step after it reads nothing
    DreamConfig(gen_length=16, steps=2, block_length=8, use_cache=True, dual_cache=True, temperature=0.0, top_p=None),
], ids=["one-block", "origin", "prefix-cache", "dual-cache-one-step"])
def test_dream_computes_the_logits_before_its_masks_only(bidirectional_model, calls, config):
    result = run_decoder("dream", bidirectional_model, PROMPT, config, mask_token_id=MASK_ID, eos_token_id=None,
                         generator=torch.Generator().manual_seed(0))
    for ids, rows in calls:
        assert rows <= int((ids == MASK_ID).sum()) < ids.shape[1]
    assert calls[0][1] == (1 if config.use_cache and config.steps_per_block > 1 else config.block_tokens)
    if config.steps_per_block == 1:
        assert [rows for _, rows in calls] == [8, 0, 8, 0] and result.stats.forwards == 4


@pytest.mark.parametrize("shifted", [False, True])
def test_d2f_computes_the_logits_of_its_decoding_blocks_masks_only(bidirectional_model, calls, shifted):
    config = D2FConfig(gen_length=16, block_size=4, block_add_threshold=0.5, decoded_token_threshold=0.5,
                       skip_threshold=0.2)
    decoder = "dream-d2f" if shifted else "llada-d2f"
    run_decoder(decoder, bidirectional_model, PROMPT, config, mask_token_id=MASK_ID, eos_token_id=None)
    for ids, rows in calls:  # shifted: also the last position a call caches, for the next call's first mask
        assert rows <= int((ids == MASK_ID).sum()) + shifted < ids.shape[1]


def test_the_call_asks_for_the_last_columns_by_count_and_any_others_by_index(bidirectional_model):
    every, last, some = torch.arange(6), torch.arange(3, 6), torch.tensor([1, 4])
    none = torch.zeros(0, dtype=torch.long)
    assert logits_at(bidirectional_model, every, 6) == {}
    assert logits_at(bidirectional_model, last, 6) == {"logits_to_keep": 3}
    assert logits_at(bidirectional_model, some, 6)["logits_to_keep"] is some
    assert logits_at(bidirectional_model, none, 6)["logits_to_keep"] is none  # an int 0 would keep every column
    logits = torch.arange(12.0).view(1, 6, 2)
    assert torch.equal(kept_logits(logits, some), logits[:, [1, 4]])  # a model that computed every column
    assert kept_logits(logits[:, [1, 4]], some).shape == (1, 2, 2)
