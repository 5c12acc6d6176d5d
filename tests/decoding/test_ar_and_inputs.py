"""The AR decoder against transformers' greedy generate, and the inputs every decoder refuses."""

from __future__ import annotations

import pytest
import torch

from refusion_cli.decoding import ARConfig, ConfigError, ReFusionConfig, run_decoder
from refusion_cli.errors import UserError
from tests.decoding.conftest import greedy
from tests.tiny import EOS_ID, MASK_ID, tiny_qwen3


@pytest.mark.parametrize("seed, prompt_len, max_new", [(0, 1, 20), (1, 7, 33), (2, 15, 8), (3, 4, 40)])
def test_ar_matches_generate_token_for_token(seed, prompt_len, max_new):
    model = tiny_qwen3(seed, init_std=0.3)
    prompt = torch.randint(0, 60, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    expected = model.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=EOS_ID,
                              pad_token_id=0)[0, prompt_len:].tolist()
    result = greedy(model, prompt, max_new, EOS_ID)
    assert result.tokens == expected
    assert result.stats.forwards == len(result.tokens) == result.stats.tokens
    assert result.stats.tpf == 1.0


def test_ar_stops_at_eos():
    model = tiny_qwen3(0, init_std=0.3)
    prompt = [5, 9, 2]
    free = greedy(model, prompt, 30, None).tokens
    eos = free[10]
    stopped = greedy(model, prompt, 30, eos)
    assert stopped.tokens == free[: free.index(eos) + 1]


def test_ar_stops_at_any_of_several_eos_ids_as_generate_does():
    model = tiny_qwen3(0, init_std=0.3)
    prompt = [5, 9, 2]
    free = greedy(model, prompt, 30, None).tokens
    other = free[10]
    assert EOS_ID not in free[:11] and other not in free[:10]
    stopped = greedy(model, prompt, 30, (EOS_ID, other))
    assert stopped.tokens == free[:11] and stopped.stats.tokens == 11
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                              eos_token_id=[EOS_ID, other], pad_token_id=0)[0, 3:].tolist()
    assert stopped.tokens == expected


def test_an_eos_id_outside_the_vocabulary_is_refused():
    model = tiny_qwen3(0)
    with pytest.raises(UserError, match="eos_token_id 151643 is outside the model's vocabulary"):
        greedy(model, [1, 2], 4, (EOS_ID, 151643))


@pytest.mark.parametrize("decode", ["ar", "refusion"])
def test_empty_prompt_is_refused(decode):
    model = tiny_qwen3(0)
    with pytest.raises(UserError, match="the prompt is empty"):
        if decode == "ar":
            greedy(model, [], 4, EOS_ID)
        else:
            run_decoder("refusion", model, [], ReFusionConfig(gen_length=8, slot_size=4), mask_token_id=MASK_ID,
                        eos_token_id=EOS_ID)


def test_prompt_plus_budget_beyond_the_context_is_refused():
    model = tiny_qwen3(0, max_positions=64)
    config = ReFusionConfig(gen_length=60, slot_size=8)  # padded to 64, + 3 prompt tokens = 67 > 64
    with pytest.raises(UserError, match="67 tokens exceeds the model's context of 64"):
        run_decoder("refusion", model, [1, 2, 3], config, mask_token_id=MASK_ID, eos_token_id=EOS_ID)
    with pytest.raises(UserError, match="exceeds the model's context of 64"):
        greedy(model, [1, 2, 3], 62, EOS_ID)


def test_mask_id_outside_the_vocabulary_is_refused():
    model = tiny_qwen3(0)
    with pytest.raises(UserError, match="mask_token_id 151670 is outside the model's vocabulary"):
        run_decoder("refusion", model, [1, 2], ReFusionConfig(gen_length=8, slot_size=4), mask_token_id=151670,
                    eos_token_id=EOS_ID)


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_the_ar_budget_must_be_positive(value):
    with pytest.raises(ConfigError, match="gen_length must be a positive integer"):
        run_decoder("ar", tiny_qwen3(0), [1, 2], ARConfig(gen_length=value), mask_token_id=None, eos_token_id=EOS_ID)
