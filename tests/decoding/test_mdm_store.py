"""The masked-diffusion calls on a K/V store: rows decode as alone, with per-row or packed attention, a row that
leaves frees its store row for the next (no K/V moves), and a step reads device values back once at most."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refusion_cli.decoding import D2FConfig, DreamConfig, LLaDAConfig
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.mdm import CanvasRunner
from refusion_cli.decoding.registry import calls_kind
from tests.tiny import MASK_ID, tiny_qwen3

PROMPTS = [[5, 17, 3], [9, 11, 30, 2, 41, 7, 8], [22, 9], [40, 22, 9, 11, 30], [3, 3, 3, 3]]
CACHED: dict[str, Any] = {
    "llada": LLaDAConfig(gen_length=16, steps=16, block_length=8, threshold=0.5, use_cache=True, dual_cache=True),
    "dream": DreamConfig(gen_length=16, steps=16, block_length=8, threshold=0.5, use_cache=True,
                         alg="maskgit_plus", temperature=0.0, top_p=None),
    "llada-d2f": D2FConfig(gen_length=16, block_size=4, block_add_threshold=0.5, decoded_token_threshold=0.5,
                           skip_threshold=0.2),
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_qwen3(3, causal=False, init_std=0.5)


def decode(model: torch.nn.Module, name: str, packed: bool) -> tuple[list[list[int]], Engine, CanvasRunner]:
    engine = Engine(model, max_rows=2)
    calls = CanvasRunner(model, packed=packed)
    engine.calls[calls_kind(name)] = calls
    results = run_decoder(name, model, PROMPTS, CACHED[name], mask_token_id=MASK_ID, eos_token_id=None,
                          batch_size=2, engine=engine)
    return [result.tokens for result in results], engine, calls


@pytest.mark.parametrize("packed", [False, True], ids=["per-row", "packed"])
@pytest.mark.parametrize("name", list(CACHED))
def test_cached_rows_refill_freed_store_rows_and_decode_as_alone(model, name, packed):
    alone = [run_decoder(name, model, prompt, CACHED[name], mask_token_id=MASK_ID, eos_token_id=None).tokens
             for prompt in PROMPTS]
    batched, engine, calls = decode(model, name, packed)
    assert batched == alone
    assert engine.counts.readbacks <= engine.counts.steps  # one readback a round, for every row at once
    assert not calls.slots  # every row left; its store went with the last one
