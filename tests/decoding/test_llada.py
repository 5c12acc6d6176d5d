"""LLaDA's sampler on a tiny bidirectional Qwen3: schedule, blocks, guidance, Fast-dLLM options, errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from refusion_cli.decoding import ConfigError, LLaDAConfig, run_decoder
from refusion_cli.decoding.mdm import even_schedule
from refusion_cli.errors import UserError
from tests.decoding.scripted import FixedRowsModel, log_probs
from tests.tiny import MASK_ID, VOCAB, tiny_qwen3

SMALL = LLaDAConfig(gen_length=16, steps=8, block_length=8)  # 2 blocks, 4 steps each, 2 tokens a step


def run(model, prompt, config=SMALL, seed=0, **kwargs):
    return run_decoder("llada", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=None,
                       generator=torch.Generator().manual_seed(seed), **kwargs)


def unmasked_offsets(result) -> list[int]:
    return [offset for step in result.trace for offset in step.offsets]


def test_reference_defaults():
    config = LLaDAConfig()
    assert (config.gen_length, config.steps, config.block_length) == (128, 128, 32)
    assert (config.remasking, config.temperature, config.cfg_scale) == ("low_confidence", 0.0, 0.0)
    assert config.threshold is None and config.use_cache is False and config.dual_cache is False


def test_even_schedule_spreads_the_remainder_over_the_first_steps():
    assert even_schedule(10, 4) == [3, 3, 2, 2]
    assert even_schedule(8, 4) == [2, 2, 2, 2]
    assert even_schedule(3, 5) == [1, 1, 1, 0, 0]


def test_one_forward_per_step_and_every_mask_filled_once(bidirectional_model, prompt):
    result = run(bidirectional_model, prompt)
    assert result.stats.forwards == SMALL.steps
    assert len(result.tokens) == SMALL.gen_length and MASK_ID not in result.tokens
    assert sorted(unmasked_offsets(result)) == list(range(SMALL.gen_length))  # each position exactly once
    assert [len(step.offsets) for step in result.trace] == [2] * 8  # the even schedule, 8 tokens / 4 steps


def test_uneven_schedule_per_block(bidirectional_model, prompt):
    config = LLaDAConfig(gen_length=16, steps=6, block_length=8)  # 3 steps for 8 tokens: 3, 3, 2
    result = run(bidirectional_model, prompt, config)
    assert result.stats.forwards == 6
    assert [len(step.offsets) for step in result.trace] == [3, 3, 2, 3, 3, 2]


def test_blocks_are_decoded_left_to_right(bidirectional_model, prompt):
    """Random ranking would pick positions anywhere; nothing right of the current block may go early."""
    config = LLaDAConfig(gen_length=24, steps=12, block_length=8, remasking="random", temperature=1.0)
    result = run(bidirectional_model, prompt, config, seed=3)
    done: set[int] = set()
    for step in result.trace:
        first, last = step.block * 8, step.block * 8 + 8
        assert all(first <= offset < last for offset in step.offsets)
        assert set(range(first)) <= done  # every earlier block is finished
        assert not any(offset >= last for offset in done)  # nothing right of this block is unmasked
        done.update(step.offsets)
    assert [step.block for step in result.trace] == [0] * 4 + [1] * 4 + [2] * 4


def test_logits_are_read_unshifted(bidirectional_model, prompt, steer_logits, one_hot):
    """Steer position q to predict token 10 + q: LLaDA must write 10 + q at position q (no shift)."""
    steer_logits(bidirectional_model, lambda positions: one_hot(10 + positions))
    for use_cache in (False, True):
        result = run(bidirectional_model, prompt, dataclasses.replace(SMALL, use_cache=use_cache))
        assert result.tokens == [10 + len(prompt) + offset for offset in range(16)]


def test_the_mask_token_is_never_a_prediction(bidirectional_model, prompt, steer_logits, one_hot):
    steer_logits(bidirectional_model, lambda positions: one_hot(torch.full_like(positions, MASK_ID)))
    raw = bidirectional_model(input_ids=torch.tensor([prompt + [MASK_ID] * 16])).logits
    assert bool((raw[0, len(prompt):].argmax(-1) == MASK_ID).all())  # the model itself wants masks
    result = run(bidirectional_model, prompt)
    assert MASK_ID not in result.tokens and len(result.tokens) == 16


def test_sampling_follows_the_explicit_generator(bidirectional_model, prompt):
    config = LLaDAConfig(gen_length=16, steps=8, block_length=8, remasking="random", temperature=1.0)
    first, again = run(bidirectional_model, prompt, config, seed=7), run(bidirectional_model, prompt, config, seed=7)
    other = run(bidirectional_model, prompt, config, seed=8)
    assert first.tokens == again.tokens and first.trace == again.trace
    assert (first.tokens, unmasked_offsets(first)) != (other.tokens, unmasked_offsets(other))


def test_on_step_streams_the_trace(bidirectional_model, prompt):
    seen = []
    result = run(bidirectional_model, prompt, on_step=seen.append)
    assert seen == result.trace and len(seen) == SMALL.steps


# ---------------------------------------------------------------------------------------------
# classifier-free guidance


def test_guidance_adds_an_unconditional_pass_per_step(bidirectional_model, prompt, record_calls):
    calls = record_calls(bidirectional_model)
    result = run(bidirectional_model, prompt, dataclasses.replace(SMALL, cfg_scale=1.5))
    assert result.stats.forwards == len(calls) == 2 * SMALL.steps
    n_prompt = len(prompt)
    for cond, uncond in zip(calls[0::2], calls[1::2]):
        assert cond[0, :n_prompt].tolist() == prompt
        assert bool((uncond[0, :n_prompt] == MASK_ID).all())  # the prompt replaced by masks
        assert torch.equal(uncond[0, n_prompt:], cond[0, n_prompt:])  # the same response state
    assert MASK_ID not in result.tokens


def test_guidance_combines_logits_as_the_reference(bidirectional_model, prompt):
    """First step, one token: the winner of un + (s + 1)(cond - un), computed here by hand."""
    config = LLaDAConfig(gen_length=8, steps=8, block_length=8, cfg_scale=1.5)
    n_prompt = len(prompt)
    canvas = torch.tensor([prompt + [MASK_ID] * 8])
    unprompted = torch.full_like(canvas, MASK_ID)
    cond = bidirectional_model(input_ids=canvas).logits[0, n_prompt:]
    uncond = bidirectional_model(input_ids=unprompted).logits[0, n_prompt:]
    guided = uncond + 2.5 * (cond - uncond)
    best_prob, best_token = guided.softmax(-1).max(-1)  # over the whole vocabulary, as the reference
    assert not bool((best_token == MASK_ID).any())
    offset = int(best_prob.argmax())
    result = run(bidirectional_model, prompt, config)
    assert result.trace[0].offsets == [offset]
    assert result.trace[0].tokens == [int(best_token[offset])]
    plain = run(bidirectional_model, prompt, dataclasses.replace(config, cfg_scale=0.0))
    assert plain.tokens != result.tokens  # guidance changes the answer on this model


def test_guidance_with_the_prefix_cache(causal_model, prompt):
    """Two cached streams (with and without the prompt); exact on a causal model, as below."""
    config = dataclasses.replace(SMALL, cfg_scale=1.0)
    plain = run(causal_model, prompt, config)
    cached = run(causal_model, prompt, dataclasses.replace(config, use_cache=True))
    assert cached.tokens == plain.tokens and cached.trace == plain.trace
    assert cached.stats.forwards == plain.stats.forwards == 2 * SMALL.steps


# ---------------------------------------------------------------------------------------------
# Fast-dLLM options


def test_threshold_zero_fills_each_block_in_one_forward(bidirectional_model, prompt):
    result = run(bidirectional_model, prompt, dataclasses.replace(SMALL, threshold=0.0))
    assert result.stats.forwards == 2  # one per block
    assert [sorted(step.offsets) for step in result.trace] == [list(range(8)), list(range(8, 16))]
    assert MASK_ID not in result.tokens


def test_threshold_unmasks_in_parallel_with_fewer_forwards(bidirectional_model, prompt):
    config = LLaDAConfig(gen_length=16, steps=16, block_length=8, threshold=0.3)
    result = run(bidirectional_model, prompt, config)
    assert 2 < result.stats.forwards < config.steps  # some steps took several tokens, not all
    assert any(len(step.offsets) > 1 for step in result.trace)
    assert sorted(unmasked_offsets(result)) == list(range(16)) and MASK_ID not in result.tokens


def test_threshold_one_is_the_one_token_schedule(bidirectional_model, prompt):
    """With steps == gen_length the schedule takes 1 token a step, the most confident one; threshold
    1.0 takes the best one plus those with probability >= 1, i.e. none on a float64 model."""
    config = LLaDAConfig(gen_length=16, steps=16, block_length=8)
    plain = run(bidirectional_model, prompt, config)
    strict = run(bidirectional_model, prompt, dataclasses.replace(config, threshold=1.0))
    assert strict.tokens == plain.tokens and strict.trace == plain.trace
    assert strict.stats.forwards == plain.stats.forwards == 16


def test_prefix_cache_is_exact_on_a_causal_model(causal_model, prompt):
    """A causal token's K/V depends only on tokens left of it, so the prefix K/V kept from the block's
    first pass is what a full pass would compute at every later step: same output, fewer positions."""
    config = LLaDAConfig(gen_length=24, steps=12, block_length=8)
    plain = run(causal_model, prompt, config)
    cached = run(causal_model, prompt, dataclasses.replace(config, use_cache=True))
    assert cached.tokens == plain.tokens and cached.trace == plain.trace
    assert cached.stats.forwards == plain.stats.forwards == 12
    assert cached.stats.positions < plain.stats.positions


def test_prefix_cache_is_exact_when_each_block_takes_one_step(bidirectional_model, prompt):
    """Each block's only step is the full pass that fills the cache, so nothing stale is ever read; the
    cached step that always follows it finds nothing to unmask (two forwards a block)."""
    config = LLaDAConfig(gen_length=16, steps=2, block_length=8)
    plain = run(bidirectional_model, prompt, config)
    cached = run(bidirectional_model, prompt, dataclasses.replace(config, use_cache=True))
    assert cached.tokens == plain.tokens and plain.stats.forwards == 2 and cached.stats.forwards == 4
    assert [len(step.offsets) for step in cached.trace] == [8, 0, 8, 0]


@pytest.mark.parametrize("dual_cache", [False, True])
def test_a_full_pass_that_finishes_the_block_is_followed_by_a_cached_step(bidirectional_model, prompt, dual_cache):
    """Threshold 0 unmasks a whole block in its full pass; a cached step still follows, as in Fast-dLLM's
    cached samplers (they look for a finished block only after a cached step), and changes nothing."""
    config = LLaDAConfig(gen_length=16, steps=2, block_length=8, threshold=0.0, use_cache=True, dual_cache=dual_cache)
    cached = run(bidirectional_model, prompt, config)
    plain = run(bidirectional_model, prompt, dataclasses.replace(config, use_cache=False, dual_cache=False))
    assert cached.tokens == plain.tokens and plain.stats.forwards == 2 and cached.stats.forwards == 4
    assert [(step.block, step.step, len(step.offsets)) for step in cached.trace] == [(0, 0, 8), (0, 1, 0),
                                                                                      (1, 0, 8), (1, 1, 0)]


def test_dual_cache_is_exact_on_a_causal_model(causal_model, prompt, record_calls):
    """A causal query never sees the suffix, so the dual cache gives the full passes' output, feeding the
    block alone after each block's full pass; the prefix cache feeds the block and everything right of it."""
    config = LLaDAConfig(gen_length=24, steps=12, block_length=8)
    plain = run(causal_model, prompt, config)
    widths = {}
    results = {}
    for name, options in {"prefix": dict(use_cache=True), "dual": dict(use_cache=True, dual_cache=True)}.items():
        calls = record_calls(causal_model)
        results[name] = run(causal_model, prompt, dataclasses.replace(config, **options))
        widths[name] = [call.shape[1] for call in calls]
        assert results[name].tokens == plain.tokens and results[name].trace == plain.trace
        assert results[name].stats.forwards == 12
    full = len(prompt) + 24
    assert widths["prefix"] == [full, 24, 24, 24, full, 16, 16, 16, full, 8, 8, 8]  # 4 steps a block
    assert widths["dual"] == [full, 8, 8, 8] * 3
    assert results["dual"].stats.positions < results["prefix"].stats.positions < plain.stats.positions


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_dual_cache_on_a_bidirectional_model(bidirectional_model, prompt, record_calls, threshold):
    """Approximate like the prefix cache (the suffix's K/V too were computed before the block filled), but a
    whole decode: every mask filled once, the cached steps feeding the block alone, also with guidance (two
    streams, each with its own cache); exact when a block takes one step."""
    config = LLaDAConfig(gen_length=24, steps=12, block_length=8, threshold=threshold, use_cache=True,
                         dual_cache=True)
    for guided in (config, dataclasses.replace(config, cfg_scale=1.0)):
        calls = record_calls(bidirectional_model)
        result = run(bidirectional_model, prompt, guided)
        assert sorted(unmasked_offsets(result)) == list(range(24)) and MASK_ID not in result.tokens
        assert {call.shape[1] for call in calls} == {len(prompt) + 24, 8} and result.stats.forwards == len(calls)
        calls.clear()
    if threshold is not None:
        assert any(len(step.offsets) > 1 for step in result.trace) and result.stats.forwards < 2 * 24
    one_step = LLaDAConfig(gen_length=16, steps=2, block_length=8, use_cache=True, dual_cache=True)
    assert run(bidirectional_model, prompt, one_step).tokens == \
        run(bidirectional_model, prompt, dataclasses.replace(one_step, use_cache=False, dual_cache=False)).tokens


def test_prefix_cache_is_approximate_on_a_bidirectional_model(bidirectional_model, prompt):
    """Approximate: the prefix K/V was computed while the block was masked and would change as it
    fills. On this model most tokens still agree (the bound is what it shows, with margin)."""
    config = LLaDAConfig(gen_length=32, steps=32, block_length=8)
    plain = run(bidirectional_model, prompt, config)
    cached = run(bidirectional_model, prompt, dataclasses.replace(config, use_cache=True))
    agree = sum(a == b for a, b in zip(plain.tokens, cached.tokens)) / len(plain.tokens)
    assert agree >= 0.6
    assert MASK_ID not in cached.tokens and cached.stats.forwards == 32
    assert cached.stats.positions < plain.stats.positions


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gen_length": 20, "block_length": 8}, "gen_length (20) must be a multiple of block_length (8)"),
        ({"gen_length": 32, "block_length": 8, "steps": 6}, "steps (6) must be a multiple of the number of blocks"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"steps": -4}, "steps must be a positive integer"),
        ({"threshold": 1.5}, "threshold must be in [0, 1]"),
        ({"threshold": -0.1}, "threshold must be in [0, 1]"),
        ({"remasking": "lowest"}, "remasking must be one of low_confidence, random"),
        ({"cfg_scale": -1.0}, "cfg_scale must be >= 0"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"dual_cache": True}, "dual_cache extends the prefix cache: set use_cache=true with it"),
        ({"use_cache": True, "dual_cache": 1}, "dual_cache must be true or false, got 1"),
    ],
)
def test_impossible_settings_fail_at_config_time(options, message):
    with pytest.raises(ConfigError) as caught:
        LLaDAConfig(**options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_mask_id_outside_the_vocabulary_is_refused(bidirectional_model, prompt):
    with pytest.raises(UserError, match=f"mask_token_id {VOCAB} is outside the model's vocabulary"):
        run_decoder("llada", bidirectional_model, prompt, SMALL, mask_token_id=VOCAB, eos_token_id=None)


# ---------------------------------------------------------------------------------------------
# token for token against LLaDA's generate.py


def reference_llada(model, prompt: list[int], *, steps: int, gen_length: int, block_length: int,
                    cfg_scale: float, mask_id: int) -> list[int]:
    """LLaDA's ``generate`` at temperature 0 restated slowly, position by position: one pass per
    conditioning stream; guidance combined in the model's dtype; argmax and softmax in float64 over
    the whole vocabulary; per block, masks // steps a step with the remainder on the first steps;
    the most confident masks of the block go, equal ones leftmost first."""
    x, n_prompt = list(prompt) + [mask_id] * gen_length, len(prompt)
    steps_per_block = steps // (gen_length // block_length)
    for start in range(n_prompt, n_prompt + gen_length, block_length):
        block = range(start, start + block_length)
        n_masked = sum(x[i] == mask_id for i in block)
        counts = [n_masked // steps_per_block + (s < n_masked % steps_per_block) for s in range(steps_per_block)]
        for count in counts:
            logits = model(input_ids=torch.tensor([x])).logits[0]
            if cfg_scale > 0:
                unprompted = [mask_id] * n_prompt + x[n_prompt:]
                unconditional = model(input_ids=torch.tensor([unprompted])).logits[0]
                logits = unconditional + (cfg_scale + 1) * (logits - unconditional)
            logits = logits.to(torch.float64)
            candidates = []
            for i in block:
                if x[i] == mask_id:
                    token = int(logits[i].argmax())
                    candidates.append((-float(logits[i].softmax(-1)[token]), i, token))
            for _, i, token in sorted(candidates)[:count]:
                x[i] = token
    return x[n_prompt:]


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        (torch.float64, LLaDAConfig(gen_length=16, steps=16, block_length=8)),
        (torch.float64, LLaDAConfig(gen_length=16, steps=6, block_length=8)),
        (torch.float64, LLaDAConfig(gen_length=16, steps=8, block_length=16, cfg_scale=1.5)),
        (torch.bfloat16, LLaDAConfig(gen_length=32, steps=32, block_length=8, cfg_scale=0.5)),
    ],
    ids=["float64", "uneven-steps", "guidance", "bf16-guidance"],
)
def test_tokens_equal_a_restatement_of_the_reference(prompt, dtype, config):
    model = tiny_qwen3(seed=1, causal=False, init_std=0.4, dtype=dtype)
    expected = reference_llada(model, prompt, steps=config.steps, gen_length=config.gen_length,
                               block_length=config.block_length, cfg_scale=config.cfg_scale, mask_id=MASK_ID)
    assert MASK_ID not in expected  # the reference never predicted the mask here: no deliberate difference
    assert run(model, prompt, config).tokens == expected


def test_confidence_is_the_float64_softmax():
    """Two float32 rows whose top probabilities compare one way in float32 and the other in float64:
    the reference ranks in float64, so the second position goes first."""
    first = [value / 64 for value in (45, -77, 99, -70, -2, -11, 61, 136)] + [-math.inf]
    second = [value / 4096 for value in (8703, -701, -4930, -4482, 6333, 3906, -126, 2877)] + [-math.inf]
    model = FixedRowsModel({1: first, 2: second}, default=first, dtype=torch.float32)
    config = LLaDAConfig(gen_length=2, steps=2, block_length=2)
    result = run_decoder("llada", model, [0], config, mask_token_id=8, eos_token_id=None)
    assert [step.offsets for step in result.trace] == [[1], [0]]


def test_the_mask_keeps_its_share_of_the_confidence():
    """Offset 0: top token 0.5 with the mask at 0.4; offset 1: top token 0.6. The reference's softmax
    spans the whole vocabulary (0.5 < 0.6); without the mask the first would read 0.5 / 0.6."""
    first, second = log_probs([0.5, 0.05, 0.05, 0.4]), log_probs([0.1, 0.6, 0.3 - 1e-9, 1e-9])
    model = FixedRowsModel({1: first, 2: second}, default=first)
    result = run_decoder("llada", model, [0], LLaDAConfig(gen_length=2, steps=2, block_length=2),
                         mask_token_id=3, eos_token_id=None)
    assert [step.offsets for step in result.trace] == [[1], [0]]
    assert result.tokens == [0, 1]


def test_equal_confidences_go_leftmost_first():
    """torch.topk leaves the order of ties unspecified (the CPU's is not the GPU's); a decode must not."""
    model = FixedRowsModel({}, default=log_probs([0.7, 0.2, 0.1 - 1e-9, 1e-9]))
    result = run_decoder("llada", model, [0], LLaDAConfig(gen_length=8, steps=4, block_length=8),
                         mask_token_id=3, eos_token_id=None)
    assert [step.offsets for step in result.trace] == [[0, 1], [2, 3], [4, 5], [6, 7]]
