"""Fixtures for the decoder tests: tiny float64 models and hooks that watch or steer their calls, and
``greedy``, the AR decoder through ``run_decoder``."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from refusion_cli.decoding import ARConfig, run_decoder
from refusion_cli.decoding.stats import EosIds
from tests.decoding.reference import MODEL_SEEDS
from tests.tiny import VOCAB, tiny_qwen3


def greedy(model: torch.nn.Module, prompt_ids: Any, gen_length: int, eos_token_id: EosIds, **options: Any) -> Any:
    """``run_decoder("ar", ...)``: greedy decoding of at most ``gen_length`` new tokens (no mask token)."""
    return run_decoder("ar", model, prompt_ids, ARConfig(gen_length=gen_length), mask_token_id=None,
                       eos_token_id=eos_token_id, **options)


@pytest.fixture(scope="session")
def prompt() -> list[int]:
    """One prompt for every decoder test (6 tokens, no special ids)."""
    return [5, 17, 3, 40, 22, 9]


@pytest.fixture(scope="session")
def bidirectional_model() -> torch.nn.Module:
    """A bidirectional tiny Qwen3 (the MDM family); init_std 0.4 gives top probabilities near 0.5."""
    return tiny_qwen3(seed=1, causal=False, init_std=0.4)


@pytest.fixture(scope="session")
def causal_model() -> torch.nn.Module:
    """A causal tiny Qwen3 (the AR / ReFusion family)."""
    return tiny_qwen3(seed=2, causal=True, init_std=0.4)


@pytest.fixture(scope="module")
def models() -> dict[int, torch.nn.Module]:
    """A causal tiny Qwen3 per seed of ``MODEL_SEEDS`` (init_std 0.6), for the sweeps over ``CONFIGS``."""
    return {seed: tiny_qwen3(seed, init_std=0.6) for seed in MODEL_SEEDS}


@pytest.fixture
def record_calls() -> Callable[[torch.nn.Module], list[torch.Tensor]]:
    """``record_calls(model)`` -> a list that receives the input_ids [1, Q] of every later call of ``model``."""
    handles = []

    def start(model: torch.nn.Module) -> list[torch.Tensor]:
        calls: list[torch.Tensor] = []

        def hook(module, args, kwargs):
            calls.append((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).clone())

        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        return calls

    yield start
    for handle in handles:
        handle.remove()


@pytest.fixture
def steer_logits() -> Callable[[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]], None]:
    """``steer_logits(model, bias_for)`` adds ``bias_for(position_ids [Q])`` ([Q, V]) to every call's logits
    (to the rows of the positions it computed, when the call asked for some only)."""
    handles = []

    def start(model: torch.nn.Module, bias_for: Callable[[torch.Tensor], torch.Tensor]) -> None:
        def hook(module, args, kwargs, out):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.arange(ids.shape[1])[None]
            kept = kwargs.get("logits_to_keep", 0)
            positions = positions[0, -kept:] if isinstance(kept, int) else positions[0, kept]
            out.logits = out.logits + bias_for(positions).to(out.logits)[None]
            return out

        handles.append(model.register_forward_hook(hook, with_kwargs=True))

    yield start
    for handle in handles:
        handle.remove()


def one_hot_bias(tokens: torch.Tensor, strength: float = 100.0) -> torch.Tensor:
    """[Q] token ids -> [Q, VOCAB] bias that makes token ``tokens[q]`` win at row q."""
    bias = torch.zeros(tokens.numel(), VOCAB, dtype=torch.float64)
    bias[torch.arange(tokens.numel()), tokens] = strength
    return bias


@pytest.fixture
def one_hot() -> Callable[[torch.Tensor], torch.Tensor]:
    return one_hot_bias
