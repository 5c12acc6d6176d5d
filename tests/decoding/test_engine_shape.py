"""What a GPU would wait on: the engine reads the rows' values back once a step whatever the number of rows, and
with packed attention a call of many rows makes one attention call per layer, decoding the same tokens."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from refusion_cli.decoding import ARConfig, ReFusionConfig
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.variants import Variant
from tests.decoding.test_batched import prompts_for
from tests.tiny import MASK_ID, tiny_qwen3

SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
CONFIGS: dict[str, Any] = {"ar": ARConfig(gen_length=12),
                           "refusion": ReFusionConfig(gen_length=16, slot_size=4, block_size=8)}
VARIANTS: list[Variant] = [(False, False, False), (True, True, True)]  # the paper's, and every ablation at once


class Watch(TorchFunctionMode):
    """Counts host syncs (a tensor's value read on the host) and attention calls."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = self.attention = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in SYNCS or (name == "__getitem__" and isinstance(args[1], torch.Tensor)
                             and args[1].dtype == torch.bool):
            self.syncs += 1
        self.attention += func is torch.nn.functional.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


class WatchedEngine(Engine):
    """An engine whose steps run under a :class:`Watch` (what happens between steps is not counted)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = Watch()

    def step(self) -> None:
        with self.watch:
            super().step()


@functools.cache
def decode(decoder: str, variant: Variant, packed: bool, rows: int = 4) -> tuple[WatchedEngine, list[list[int]]]:
    model = tiny_qwen3(3, init_std=0.5)
    engine = WatchedEngine(model, max_rows=rows, packed_attention=packed)
    causal_fix, causal_first, recheck = variant
    results = run_decoder(decoder, model, prompts_for(1), CONFIGS[decoder], mask_token_id=MASK_ID,
                          eos_token_id=None, engine=engine, causal_fix=causal_fix, causal_first=causal_first,
                          recheck=recheck)
    return engine, [result.tokens for result in results]


@pytest.mark.parametrize("decoder", ["ar", "refusion"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_readback_a_step_whatever_the_rows(decoder, variant):
    for rows in (1, 4):
        engine, _ = decode(decoder, variant, packed=False, rows=rows)
        counts = engine.counts
        assert engine.watch.syncs == counts.readbacks  # no row reads a value on its own
        assert counts.readbacks <= counts.steps  # at most one wait for the device a step


@pytest.mark.parametrize("decoder", ["ar", "refusion"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_attention_is_one_call_a_layer_and_the_same_tokens(decoder, variant):
    lanes, by_lane = decode(decoder, variant, packed=False)
    packed, by_batch = decode(decoder, variant, packed=True)
    assert by_batch == by_lane
    layers = lanes.model.config.num_hidden_layers
    assert packed.watch.attention < lanes.watch.attention
    # every call of more than one row is one attention call a layer; the last rows of the run may run alone
    calls = packed.watch.attention // layers
    assert packed.watch.attention == calls * layers and calls < lanes.watch.attention // layers
