"""What batching promises: a row's logits in a padded batched call are those of its call alone within
float rounding, and its answer is batch 1's unless that rounding flips a near-tie.

A batched call pads its rows to one width and lays their cached K/V side by side, so the kernels
reduce over other shapes than the row's own call: in float32 the logits differ from batch 1's by
about 1e-6 of the largest logit, and a decision that close to a tie (Dream's entropy ranking of
near-uniform positions on random weights) can go the other way. The float64 sweeps of test_batched.py check tokens row for
row; here every decoder runs in float32, as a checkpoint does, and each row's logits of every call
are compared with those of its decode alone. On the embedded models every batched answer is batch 1's.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import pytest
import torch

from refusion_cli.bench.prompts import load_prompts
from refusion_cli.decoding.config import ARConfig, ReFusionConfig
from refusion_cli.decoding.d2f import D2FConfig
from refusion_cli.decoding.dream import FAST_DLLM_PRESETS as DREAM_FAST_DLLM
from refusion_cli.decoding.dream import DreamConfig
from refusion_cli.decoding.llada import FAST_DLLM_PRESETS as LLADA_FAST_DLLM
from refusion_cli.decoding.llada import LLaDAConfig
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.mdm import HeadInput
from refusion_cli.decoding.registry import build_config, calls_kind, decoder_spec, with_length
from refusion_cli.decoding.rows import shared_calls
from refusion_cli.models import EMBEDDED, load_model
from refusion_cli.models.chat import user_prompt_ids
from tests.decoding.test_batched import prompts_for
from tests.tiny import MASK_ID, tiny_qwen3

TOLERANCE = 1e-5  # of the call's largest logit; measured: 7e-7 to 1.4e-6 (a few float32 roundings)
N = 16  # response length


D2F = D2FConfig(gen_length=N, block_size=4, block_add_threshold=0.5, decoded_token_threshold=0.5, skip_threshold=0.2)
# Table 1's decoders, each at its paper settings cut to a 16-token response
DECODERS: dict[str, Any] = {
    "ar": ARConfig(gen_length=N),
    "refusion": ReFusionConfig(gen_length=N, slot_size=4, block_size=8, slot_threshold=0.3, token_threshold=0.3),
    "llada": LLaDAConfig(gen_length=N, steps=N, block_length=8),
    "llada-fast-dllm": dataclasses.replace(LLADA_FAST_DLLM["fast-dllm"], gen_length=N, steps=N, block_length=8,
                                           threshold=0.3),
    "llada-d2f": D2F,
    "dream": DreamConfig(gen_length=N, steps=N),
    "dream-fast-dllm": dataclasses.replace(DREAM_FAST_DLLM["fast-dllm"], gen_length=N, steps=N, block_length=8,
                                           threshold=0.3),
    "dream-d2f": D2F,
}


class RecordedCalls:
    """Shared calls (``mdm.CanvasRunner`` or ``cache.CausalRunner``) that keep every row's logits of every call."""

    def __init__(self, calls: Any):
        self.calls = calls
        self.logits: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.widths: list[int] = []  # rows of each call

    def forward(self, feeds: dict[int, Any]) -> dict[int, Any]:
        replies = self.calls.forward(feeds)
        self.widths.append(len(feeds))
        for row, reply in replies.items():
            logits = reply[0] if isinstance(reply, tuple) else reply
            # a chunked row of a call that reads many positions gets the head's input: its logits are the head's
            self.logits[row].append(logits.head(logits.states) if isinstance(logits, HeadInput) else logits)
        return replies

    def close(self, row: int) -> None:
        self.calls.close(row)

    def __getattr__(self, name: str) -> Any:  # what a row opener uses of its calls (CausalRunner.open)
        return getattr(self.calls, name)


def decode(name: str, model: torch.nn.Module, prompts: list[list[int]], seeds: list[int],
           batch_size: int | None) -> tuple[list[Any], RecordedCalls]:
    """The rows' results and their logits, ``batch_size`` rows a call; row i draws from generator ``seeds[i]``."""
    engine = Engine(model, max_rows=batch_size)
    kind = calls_kind(name)
    calls = RecordedCalls(shared_calls(kind, model))
    engine.calls[kind] = calls
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    results = run_decoder(name, model, prompts, DECODERS[name], mask_token_id=MASK_ID, eos_token_id=None,
                          generator=generators, engine=engine)
    # the engine numbers requests in the order they were submitted: the prompts' order
    calls.logits = defaultdict(list, {row: calls.logits[key] for row, key in enumerate(sorted(calls.logits))})
    return results, calls


@pytest.fixture(scope="module")
def float32_models() -> dict[bool, torch.nn.Module]:
    """Tiny float32 Qwen3s: a masked-diffusion (bidirectional) one and a causal one."""
    return {True: tiny_qwen3(3, causal=False, dtype=torch.float32, init_std=0.5),
            False: tiny_qwen3(4, causal=True, dtype=torch.float32, init_std=0.5)}


@pytest.mark.parametrize("name", list(DECODERS))
def test_a_batched_call_gives_each_row_its_logits_alone_within_float_rounding(float32_models, name):
    model, prompts = float32_models[decoder_spec(name).bidirectional], prompts_for(3)
    seeds = list(range(len(prompts)))
    batched, calls = decode(name, model, prompts, seeds, batch_size=3)
    assert max(calls.widths) == 3  # rows of different prompt lengths shared padded calls
    largest = 0.0
    for row, prompt in enumerate(prompts):
        (alone,), own = decode(name, model, [prompt], [seeds[row]], batch_size=1)
        assert batched[row].tokens == alone.tokens, row  # no decision here was that close to a tie
        assert len(calls.logits[row]) == len(own.logits[0]) == alone.stats.forwards, row
        for got, expected in zip(calls.logits[row], own.logits[0], strict=True):
            assert got.shape == expected.shape
            if got.numel():
                difference = (got.double() - expected.double()).abs().max() / expected.double().abs().max()
                largest = max(largest, float(difference))
    assert largest <= TOLERANCE, (name, largest)


@pytest.fixture(scope="module")
def embedded() -> dict[str, Any]:
    """The embedded models, loaded once (as ``refusion bench`` loads them: float32 on the CPU)."""
    return {name: load_model(name, device="cpu", require_mask=name != "ar-tiny") for name in EMBEDDED}


# `make test-all`: LLaDA and Dream at their plain settings, whose rows the float64 sweeps of test_batched.py check by
# default (as every setting of theirs); their Fast-dLLM and D2F rows run here by default
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in ("llada", "dream") else name
                                  for name in DECODERS])
def test_every_batched_answer_on_the_embedded_models_is_batch_1s(embedded, name):
    # the decoders without an embedded model (Dream's, D2F's) run on mdm-tiny: a misfit, still a model with ties
    spec = decoder_spec(name)
    loaded = embedded[spec.default_model or "mdm-tiny"]
    prompts = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in load_prompts(limit=4)]
    config = build_config(name, with_length(name, {"gen_length": 64}))

    def decode(prompt_ids, seeds, **options):
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        return run_decoder(name, loaded.model, prompt_ids, config, mask_token_id=loaded.mask_token_id,
                           eos_token_id=loaded.stop_token_ids, generator=generators, **options)

    alone = [decode([prompt], [row])[0] for row, prompt in enumerate(prompts)]
    batched = decode(prompts, range(len(prompts)), batch_size=len(prompts))
    assert [result.tokens for result in batched] == [result.tokens for result in alone]
    assert [result.stats.forwards for result in batched] == [result.stats.forwards for result in alone]
