"""What a GPU would wait on: the engine reads the rows' values back once a step whatever the number of rows, and
with packed attention a call of many rows makes one attention call per layer, decoding the same tokens."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from refusion_cli.bench.counts import DecodeCounts, counting
from refusion_cli.decoding import ARConfig, D2FConfig, DreamConfig, LLaDAConfig, ReFusionConfig
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.variants import Variant
from tests.decoding.test_batched import prompts_for
from tests.tiny import MASK_ID, tiny_qwen3

CONFIGS: dict[str, Any] = {"ar": ARConfig(gen_length=12),
                           "refusion": ReFusionConfig(gen_length=16, slot_size=4, block_size=8)}
VARIANTS: list[Variant] = [(False, False, False), (True, True, True)]  # the paper's, and every ablation at once
# `make test-all` runs every ablation at once too; tests/decoding/test_batched.py batches the ablations by default
VARIANT_CASES = [VARIANTS[0], pytest.param(VARIANTS[1], marks=pytest.mark.slow)]


@functools.cache
def decode(decoder: str, variant: Variant, packed: bool, rows: int = 4) -> tuple[Engine, DecodeCounts, list[list[int]]]:
    model = tiny_qwen3(3, init_std=0.5)
    engine = Engine(model, max_rows=rows, packed_attention=packed)
    causal_fix, causal_first, recheck = variant
    with counting(model) as counts:  # bench --counts' counter: syncs inside the engine's steps, attention calls
        results = run_decoder(decoder, model, prompts_for(1), CONFIGS[decoder], mask_token_id=MASK_ID,
                              eos_token_id=None, engine=engine, causal_fix=causal_fix, causal_first=causal_first,
                              recheck=recheck)
    return engine, counts, [result.tokens for result in results]


@pytest.mark.parametrize("decoder", ["ar", "refusion"])
@pytest.mark.parametrize("variant", VARIANT_CASES)
def test_one_readback_a_step_whatever_the_rows(decoder, variant):
    for rows in (1, 4):
        engine, counts, _ = decode(decoder, variant, packed=False, rows=rows)
        assert counts.step_syncs == engine.counts.readbacks  # no row reads a value on its own
        assert engine.counts.readbacks <= engine.counts.steps  # at most one wait for the device a step


@pytest.mark.parametrize("decoder", ["ar", "refusion"])
@pytest.mark.parametrize("variant", VARIANT_CASES)
def test_packed_attention_is_one_call_a_layer_and_the_same_tokens(decoder, variant):
    _, by_row, row_tokens = decode(decoder, variant, packed=False)
    _, by_batch, batch_tokens = decode(decoder, variant, packed=True)
    assert batch_tokens == row_tokens
    layers = by_row.layers
    assert by_batch.sdpa_calls < by_row.sdpa_calls
    # every call of more than one row is one attention call a layer; the last rows of the run may run alone
    calls = by_batch.sdpa_calls // layers
    assert by_batch.sdpa_calls == calls * layers and calls < by_row.sdpa_calls // layers


def test_a_steps_tensor_ops_do_not_grow_with_the_rows_but_the_decoders_own():
    """The runner builds a call's masks and indices on the host and copies them once, and the readback is a few
    ops whatever the rows: what a row adds to a step is AR's own argmax and next position (a kernel each)."""
    _, alone, _ = decode("ar", VARIANTS[0], packed=True, rows=1)
    _, four, _ = decode("ar", VARIANTS[0], packed=True, rows=4)
    assert alone.ops_per_step() is not None and four.ops_per_step() is not None
    assert four.ops_per_step() <= alone.ops_per_step() + 2 * 3


@pytest.mark.parametrize("variant", VARIANT_CASES)
def test_refusion_decides_for_every_row_at_once(variant):
    """ReFusion's plan, verification and completion rounds are batched functions of the rows' logits; the rest of
    its bookkeeping is the host's: a row adds at most two ops to a step (its K/V moved when a row before it leaves,
    the readback of its values), and decodes the tokens it decodes alone."""
    _, alone, alone_tokens = decode("refusion", variant, packed=True, rows=1)
    _, four, four_tokens = decode("refusion", variant, packed=True, rows=4)
    assert four_tokens == alone_tokens
    assert alone.ops_per_step() is not None and four.ops_per_step() is not None
    assert four.ops_per_step() <= alone.ops_per_step() + 2 * 3


def assert_rows_add_two_ops(decoder: str, model: Any, config: Any) -> None:
    """At 4 rows a step costs at most batch 1's ops + 2 per row (the copy and the write of a row's chosen tokens),
    and every row decodes the tokens it decodes alone."""
    counted, tokens = {}, {}
    for rows in (1, 4):
        with counting(model) as counts:
            results = run_decoder(decoder, model, prompts_for(1), config, mask_token_id=MASK_ID, eos_token_id=None,
                                  engine=Engine(model, max_rows=rows))
        counted[rows], tokens[rows] = counts.ops_per_step(), [result.tokens for result in results]
    assert tokens[4] == tokens[1]
    assert counted[1] is not None and counted[4] is not None
    assert counted[4] <= counted[1] + 2 * 3


@pytest.mark.parametrize("threshold", [None, 0.5])  # LLaDA's schedule, and Fast-dLLM's threshold
def test_llada_chooses_for_every_row_at_once(threshold):
    """LLaDA's choice is one batched function for the rows of a step."""
    assert_rows_add_two_ops("llada", tiny_qwen3(3, init_std=0.5),
                            LLaDAConfig(gen_length=8, steps=8, block_length=4, threshold=threshold))


@pytest.mark.parametrize("cached", [False, True])  # Dream greedy, and Fast-dLLM's Dream (threshold, dual cache)
def test_dream_without_draws_chooses_for_every_row_at_once(cached):
    """Greedy Dream's prediction and ranking are one batched function for the rows of a step."""
    config = DreamConfig(gen_length=16, steps=16, alg="maskgit_plus", temperature=0.0, top_p=None, block_length=8,
                         threshold=0.5 if cached else None, use_cache=cached, dual_cache=cached)
    assert_rows_add_two_ops("dream", tiny_qwen3(3, causal=False, init_std=0.5), config)


@pytest.mark.parametrize("decoder", ["llada-d2f", "dream-d2f"])
def test_d2f_without_draws_chooses_for_every_row_at_once(decoder):
    """D2F's commits without draws, every decoding block of every row, are one batched function a step."""
    config = D2FConfig(gen_length=16, block_size=4, block_add_threshold=0.5, decoded_token_threshold=0.5,
                       skip_threshold=0.5)
    assert_rows_add_two_ops(decoder, tiny_qwen3(3, causal=False, init_std=0.5), config)
