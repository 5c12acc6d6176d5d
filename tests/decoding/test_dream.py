"""Dream's sampler on a tiny bidirectional Qwen3: shifted reads, timestep schedule, algorithms, options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refusion_cli.decoding import ConfigError, DreamConfig, run_decoder
from refusion_cli.decoding.dream import filter_logits
from refusion_cli.errors import UserError
from tests.decoding.conftest import one_hot_bias
from tests.decoding.scripted import FixedRowsModel, log_probs
from tests.tiny import MASK_ID, VOCAB, tiny_qwen3

GREEDY = DreamConfig(gen_length=16, steps=8, alg="maskgit_plus", temperature=0.0, top_p=None)


def run(model, prompt, config=GREEDY, seed=0, **kwargs):
    return run_decoder("dream", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=None,
                       generator=torch.Generator().manual_seed(seed), **kwargs)


def unmasked_offsets(result) -> list[int]:
    return [offset for step in result.trace for offset in step.offsets]


def test_readme_defaults():
    config = DreamConfig()
    assert (config.gen_length, config.steps, config.alg, config.alg_temp) == (512, 512, "entropy", 0.0)
    assert (config.eps, config.temperature, config.top_p, config.top_k) == (1e-3, 0.2, 0.95, None)
    assert config.block_length is None and config.threshold is None and config.use_cache is False
    assert config.dual_cache is False


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_one_forward_per_step_and_every_mask_filled_once(bidirectional_model, prompt, alg):
    config = DreamConfig(gen_length=16, steps=8, alg=alg)  # README sampling: temperature 0.2, top_p 0.95
    result = run(bidirectional_model, prompt, config, seed=4)
    assert result.stats.forwards == 8 and len(result.trace) == 8
    assert len(result.tokens) == 16 and MASK_ID not in result.tokens
    assert sorted(unmasked_offsets(result)) == list(range(16))
    assert {step.block for step in result.trace} == {0}  # Dream: the whole response is one block


def test_timestep_schedule_unmasks_int_n_times_one_minus_s_over_t(bidirectional_model, prompt):
    """Counts recomputed here from linspace(1, eps, steps + 1); the last step takes what is left."""
    result = run(bidirectional_model, prompt)
    steps, eps, left, expected = 8, 1e-3, 16, []
    for step in range(steps):
        t, s = 1 - step * (1 - eps) / steps, 1 - (step + 1) * (1 - eps) / steps
        count = left if step == steps - 1 else int(left * (1 - s / t))
        expected.append(count)
        left -= count
    assert [len(step.offsets) for step in result.trace] == expected == [1, 2, 2, 2, 2, 2, 2, 3]


def test_logits_are_read_shifted(bidirectional_model, prompt, steer_logits, one_hot):
    """Steer position q to predict token 10 + q: Dream must write 10 + q - 1 at position q."""
    steer_logits(bidirectional_model, lambda positions: one_hot(10 + positions))
    start = len(prompt)
    for block_length, use_cache in [(None, False), (None, True), (8, True)]:
        config = dataclasses.replace(GREEDY, block_length=block_length, use_cache=use_cache)
        result = run(bidirectional_model, prompt, config)
        assert result.tokens == [10 + start + offset - 1 for offset in range(16)]


def test_the_mask_token_is_never_a_prediction(bidirectional_model, prompt, steer_logits, one_hot):
    steer_logits(bidirectional_model, lambda positions: one_hot(torch.full_like(positions, MASK_ID)))
    result = run(bidirectional_model, prompt, DreamConfig(gen_length=16, steps=8))
    assert MASK_ID not in result.tokens and len(result.tokens) == 16


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_first_step_takes_the_most_confident_masks(bidirectional_model, prompt, alg):
    """Confidence by hand from one shifted pass: top prob, p1 - p2, or -H; step 0 takes 3 of 16."""
    config = DreamConfig(gen_length=16, steps=4, alg=alg, temperature=0.0, top_p=None)
    n_prompt = len(prompt)
    logits = bidirectional_model(input_ids=torch.tensor([prompt + [MASK_ID] * 16])).logits[0]
    logits = logits[n_prompt - 1: n_prompt + 15]  # row j predicts response offset j
    probs = logits.softmax(-1)  # over the whole vocabulary, the mask included, as the reference
    assert not bool((probs.argmax(-1) == MASK_ID).any())
    top_two = probs.topk(2, dim=-1).values
    confidence = {
        "maskgit_plus": top_two[:, 0],
        "topk_margin": top_two[:, 0] - top_two[:, 1],
        "entropy": (probs * torch.log(probs + 1e-10)).sum(-1),
    }[alg]
    result = run(bidirectional_model, prompt, config)
    assert len(result.trace[0].offsets) == 3  # int(16 * (1 - s/t)) with t = 1, s = 1 - 0.999 / 4
    assert set(result.trace[0].offsets) == set(confidence.topk(3).indices.tolist())
    assert result.trace[0].tokens == probs.argmax(-1)[result.trace[0].offsets].tolist()


def test_algorithms_differ(bidirectional_model, prompt):
    orders = {alg: unmasked_offsets(run(bidirectional_model, prompt, dataclasses.replace(GREEDY, alg=alg)))
              for alg in ("maskgit_plus", "topk_margin", "entropy")}
    assert len({tuple(order) for order in orders.values()}) > 1


@pytest.mark.parametrize(
    "config",
    [
        DreamConfig(gen_length=16, steps=8, alg="origin", temperature=0.7),
        DreamConfig(gen_length=16, steps=8, alg="entropy", alg_temp=0.5),
        DreamConfig(gen_length=16, steps=8, alg="maskgit_plus", temperature=1.0, top_p=None, top_k=8),
    ],
    ids=["origin", "alg_temp", "top_k"],
)
def test_sampling_follows_the_explicit_generator(bidirectional_model, prompt, config):
    first, again = run(bidirectional_model, prompt, config, seed=5), run(bidirectional_model, prompt, config, seed=5)
    other = run(bidirectional_model, prompt, config, seed=6)
    assert first.tokens == again.tokens and first.trace == again.trace
    assert (first.tokens, unmasked_offsets(first)) != (other.tokens, unmasked_offsets(other))
    assert sorted(unmasked_offsets(first)) == list(range(16)) and first.stats.forwards == 8


def test_top_p_keeps_the_smallest_nucleus_above_p_and_top_k_the_k_best():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64).log()
    assert torch.isfinite(filter_logits(logits, 0.7, None)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 0.4, None)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, 1.0, None)).all()
    assert torch.isfinite(filter_logits(logits, None, 3)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, 0.9, 2)).tolist() == [[True, True, False, False]]


# ---------------------------------------------------------------------------------------------
# Fast-dLLM options


def confident_everywhere(positions: torch.Tensor) -> torch.Tensor:
    """A bias that makes every position predict token 10 + position with probability ~1, more surely the
    further right it is (so the block's first position is never its surest)."""
    return one_hot_bias(10 + positions, strength=positions.double() + 30.0)


def test_threshold_without_a_cache_unmasks_at_most_an_even_share_a_step(bidirectional_model, prompt, steer_logits):
    """Every token is sure, so the threshold would take the whole response at once; without a cache the
    tokens a step are capped at the running total of an even split over ``steps`` (16 / 4 = 4 a step; with
    5 steps 4, 3, 3, 3, 3), the best ranked first, and the step count follows."""
    steer_logits(bidirectional_model, confident_everywhere)
    config = dataclasses.replace(GREEDY, threshold=0.5)
    for steps, counts in [(4, [4, 4, 4, 4]), (5, [4, 3, 3, 3, 3]), (1, [16])]:
        result = run(bidirectional_model, prompt, dataclasses.replace(config, steps=steps))
        assert [len(step.offsets) for step in result.trace] == counts
        assert result.tokens == [10 + len(prompt) + offset - 1 for offset in range(16)]
    blocks = run(bidirectional_model, prompt, dataclasses.replace(config, steps=4, block_length=8))
    assert [(step.block, len(step.offsets)) for step in blocks.trace] == [(0, 4), (0, 4), (1, 4), (1, 4)]


def test_threshold_unmasks_in_parallel_with_fewer_forwards(bidirectional_model, prompt):
    config = DreamConfig(gen_length=16, steps=4, alg="maskgit_plus", temperature=0.0, top_p=None, threshold=0.35)
    result = run(bidirectional_model, prompt, config)
    assert config.steps < result.stats.forwards < 16  # not every step took its share, some took several
    assert any(len(step.offsets) > 1 for step in result.trace)
    assert sorted(unmasked_offsets(result)) == list(range(16)) and MASK_ID not in result.tokens


def test_threshold_one_takes_one_token_a_step(bidirectional_model, prompt):
    """Probabilities < 1 on a float64 model: only the always-taken best one goes each step."""
    result = run(bidirectional_model, prompt, dataclasses.replace(GREEDY, threshold=1.0))
    assert result.stats.forwards == 16 and all(len(step.offsets) == 1 for step in result.trace)


@pytest.mark.parametrize("dual_cache", [False, True])
def test_a_cached_block_starts_with_its_first_position(bidirectional_model, prompt, steer_logits, dual_cache):
    """With a cache the full pass unmasks only the block's first position (not the surest mask), then the
    threshold rule (uncapped: here all the rest at once) or the schedule's steps 1, 2, ... follow; a block
    of one step takes every mask in its full pass (and its cached step finds none)."""
    steer_logits(bidirectional_model, confident_everywhere)
    cached = dataclasses.replace(GREEDY, block_length=8, use_cache=True, dual_cache=dual_cache)
    result = run(bidirectional_model, prompt, dataclasses.replace(cached, threshold=0.5))
    assert [(step.block, sorted(step.offsets)) for step in result.trace] == \
        [(0, [0]), (0, [1, 2, 3, 4, 5, 6, 7]), (1, [8]), (1, [9, 10, 11, 12, 13, 14, 15])]
    assert result.tokens == [10 + len(prompt) + offset - 1 for offset in range(16)]  # shifted, in both passes
    uncached = run(bidirectional_model, prompt, dataclasses.replace(cached, threshold=None, use_cache=False,
                                                                     dual_cache=False))
    assert 0 not in uncached.trace[0].offsets  # the sampler without a cache starts elsewhere
    scheduled = run(bidirectional_model, prompt, cached)  # 4 steps a block: int(7 * (1 - s/t)) = 2, then 2, 3
    assert [len(step.offsets) for step in scheduled.trace] == [1, 2, 2, 3] * 2 and scheduled.trace[0].offsets == [0]
    one_step = run(bidirectional_model, prompt, dataclasses.replace(cached, steps=2))
    assert [len(step.offsets) for step in one_step.trace] == [8, 0, 8, 0]


def reference_cached_dream(model, prompt: list[int], *, gen_length: int, block_length: int, steps: int, alg: str,
                           threshold: float | None, mask_id: int) -> list[int]:
    """Dream's cached sampler restated with a full pass at every step, greedy, in the model's dtype: per block,
    the first step writes the block's first position (the argmax of its shifted logits); later steps rank the
    block's masks by top probability or -entropy and unmask int(masks * (1 - s/t)) of them (all at the
    block's last step), or, with a threshold, the best plus every other whose token has probability
    >= threshold; a block takes at least two steps. On a causal model a cache holds exactly what these full
    passes compute, so the cached decodes equal this."""
    x = list(prompt) + [mask_id] * gen_length
    per_block = steps // (gen_length // block_length)
    timesteps = torch.linspace(1, 1e-3, per_block + 1)
    for start in range(len(prompt), len(x), block_length):
        block, step = range(start, start + block_length), 0
        while step < 2 or any(x[i] == mask_id for i in block):
            masked = [i for i in block if x[i] == mask_id]
            logits = model(input_ids=torch.tensor([x])).logits[0]
            probs = torch.stack([logits[i - 1] for i in masked]).softmax(-1) if masked else None
            if not masked:
                chosen = []
            elif step == 0:
                chosen = [0]
            else:
                top, _ = probs.max(-1)
                confidence = (probs * torch.log(probs + 1e-10)).sum(-1) if alg == "entropy" else top
                ranked = sorted(range(len(masked)), key=lambda row: (-float(confidence[row]), row))
                if threshold is not None:
                    chosen = ranked[:1] + [row for row in ranked[1:] if top[row] >= threshold]
                else:
                    t, s = timesteps[step], timesteps[step + 1]
                    chosen = ranked[: int(len(masked) * (1 - s / t)) if step < per_block - 1 else len(masked)]
            for row in chosen:
                x[masked[row]] = int(probs[row].argmax())
            step += 1
    return x[len(prompt):]


CACHED = [DreamConfig(gen_length=24, steps=12, alg="entropy", temperature=0.0, top_p=None, block_length=8),
          DreamConfig(gen_length=24, steps=3, alg="maskgit_plus", temperature=0.0, top_p=None, block_length=8,
                      threshold=0.3)]


@pytest.mark.parametrize("config", CACHED, ids=["fixed-steps", "threshold"])
def test_prefix_and_dual_cache_are_exact_on_a_causal_model(causal_model, prompt, record_calls, config):
    """Causal: the K/V left of the block never changes and the suffix is never seen, so both caches give the
    restated sampler's output; the prefix cache feeds the block and what follows it, the dual cache the block."""
    expected = reference_cached_dream(causal_model, prompt, gen_length=24, block_length=8, steps=config.steps,
                                      alg=config.alg, threshold=config.threshold, mask_id=MASK_ID)
    assert MASK_ID not in expected
    full = len(prompt) + 24
    for dual_cache in (False, True):
        calls = record_calls(causal_model)
        result = run(causal_model, prompt, dataclasses.replace(config, use_cache=True, dual_cache=dual_cache))
        assert result.tokens == expected, dual_cache
        fed = [call.shape[1] for call in calls]
        assert fed.count(full) == 3 and len(fed) == result.stats.forwards
        assert set(fed) - {full} == ({8} if dual_cache else {24, 16, 8})
        calls.clear()


@pytest.mark.parametrize("config", CACHED, ids=["fixed-steps", "threshold"])
def test_prefix_and_dual_cache_are_approximate_on_a_bidirectional_model(bidirectional_model, prompt, config):
    """Approximate: the cached K/V were computed while the block was masked and would change as it fills;
    a whole decode all the same, each mask filled once (the bound on agreement is what this model shows,
    with margin)."""
    expected = reference_cached_dream(bidirectional_model, prompt, gen_length=24, block_length=8, steps=config.steps,
                                      alg=config.alg, threshold=config.threshold, mask_id=MASK_ID)
    for dual_cache in (False, True):
        cached = run(bidirectional_model, prompt, dataclasses.replace(config, use_cache=True, dual_cache=dual_cache))
        assert sorted(unmasked_offsets(cached)) == list(range(24)) and MASK_ID not in cached.tokens
        agree = sum(a == b for a, b in zip(expected, cached.tokens)) / 24
        assert agree >= 0.3


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": 0}, "steps must be a positive integer"),
        ({"gen_length": 20, "block_length": 8}, "gen_length (20) must be a multiple of block_length (8)"),
        ({"gen_length": 32, "steps": 6, "block_length": 8}, "steps (6) must be a multiple of the number of blocks"),
        ({"threshold": 1.01}, "threshold must be in [0, 1]"),
        ({"threshold": -1.0}, "threshold must be in [0, 1]"),
        ({"alg": "confidence"}, "alg must be one of origin, maskgit_plus, topk_margin, entropy"),
        ({"alg": "origin", "threshold": 0.9}, "threshold needs a confidence ranking"),
        ({"alg_temp": 0.5, "threshold": 0.9}, "threshold and alg_temp"),
        ({"eps": 0.0}, "eps must be in (0, 1)"),
        ({"top_p": 0.0}, "top_p must be > 0"),
        ({"top_p": 1.5}, "top_p must be in [0, 1]"),
        ({"top_k": 0}, "top_k must be a positive integer"),
        ({"dual_cache": True}, "dual_cache extends the prefix cache: set use_cache=true with it"),
    ],
)
def test_impossible_settings_fail_at_config_time(options, message):
    with pytest.raises(ConfigError) as caught:
        DreamConfig(**options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_mask_id_outside_the_vocabulary_is_refused(bidirectional_model, prompt):
    with pytest.raises(UserError, match=f"mask_token_id {VOCAB + 5} is outside the model's vocabulary"):
        run_decoder("dream", bidirectional_model, prompt, GREEDY, mask_token_id=VOCAB + 5, eos_token_id=None)


# ---------------------------------------------------------------------------------------------
# token for token against Dream's generation_utils.py (diffusion_generate -> _sample)


def reference_dream(model, prompt: list[int], *, steps: int, gen_length: int, alg: str, eps: float,
                    top_p: float | None, top_k: int | None, mask_id: int) -> list[int]:
    """Dream's ``_sample`` at temperature 0 restated slowly, in the model's dtype: logits shifted by one;
    top-p drops a token once the better ones hold more than top_p, top-k the ones below the k-th
    (both to the dtype's lowest value); softmax over the whole vocabulary; confidence = top
    probability, top-two margin or -entropy; int(masks * (1 - s/t)) masks go (all at the last step),
    the most confident ones, equal ones leftmost first."""
    x = list(prompt) + [mask_id] * gen_length
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = [j for j, token in enumerate(x) if token == mask_id]
        logits = model(input_ids=torch.tensor([x])).logits[0]
        rows = torch.stack([logits[j - 1] for j in masked])  # [n, V]
        lowest = torch.finfo(rows.dtype).min
        if top_p is not None and top_p < 1:
            ordered, order = rows.sort(-1, descending=True)
            running = ordered.softmax(-1).cumsum(-1)
            drop = torch.zeros_like(running, dtype=torch.bool)
            drop[:, 1:] = running[:, :-1] > top_p
            rows = rows.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), lowest)
        if top_k is not None:
            rows = rows.masked_fill(rows < rows.topk(top_k, -1).values[:, -1:], lowest)
        probs = rows.softmax(-1)
        confidence, tokens = probs.max(-1)
        if alg == "topk_margin":
            best = probs.sort(-1, descending=True).values
            confidence = best[:, 0] - best[:, 1]
        elif alg == "entropy":
            confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
        t, s = timesteps[i], timesteps[i + 1]
        count = int(len(masked) * (1 - s / t)) if i < steps - 1 else len(masked)
        ranked = sorted(range(len(masked)), key=lambda row: (-float(confidence[row]), row))
        for row in ranked[:count]:
            x[masked[row]] = int(tokens[row])
    return x[len(prompt):]


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        (torch.float64, DreamConfig(gen_length=32, steps=32, alg="maskgit_plus", temperature=0.0, top_p=None)),
        (torch.float64, DreamConfig(gen_length=32, steps=32, alg="entropy", temperature=0.0, top_p=0.5)),
        (torch.bfloat16, DreamConfig(gen_length=32, steps=32, alg="entropy", temperature=0.0, top_p=None)),
        (torch.bfloat16, DreamConfig(gen_length=32, steps=16, alg="maskgit_plus", temperature=0.0, top_p=0.9,
                                     top_k=5)),
        (torch.bfloat16, DreamConfig(gen_length=32, steps=32, alg="topk_margin", temperature=0.0, top_p=0.5)),
    ],
    ids=["maskgit_plus", "entropy-top_p", "bf16-entropy", "bf16-top_p-top_k", "bf16-topk_margin"],
)
def test_tokens_equal_a_restatement_of_the_reference(prompt, dtype, config):
    model = tiny_qwen3(seed=1, causal=False, init_std=0.4, dtype=dtype)
    expected = reference_dream(model, prompt, steps=config.steps, gen_length=config.gen_length, alg=config.alg,
                               eps=config.eps, top_p=config.top_p, top_k=config.top_k, mask_id=MASK_ID)
    assert MASK_ID not in expected  # the reference never predicted the mask here: no deliberate difference
    assert run(model, prompt, config).tokens == expected


def test_the_mask_keeps_its_share_of_the_probabilities():
    """Offset 0: top token 0.5 with the mask at 0.4; offset 1: top token 0.6; step 0 takes one mask.
    The reference's softmax spans the whole vocabulary (0.5 < 0.6); without the mask the first
    would read 0.5 / 0.6. Row p of the logits predicts offset p (the prompt is one token)."""
    rows = {0: log_probs([0.5, 0.05, 0.05, 0.4]), 1: log_probs([0.1, 0.6, 0.3 - 1e-9, 1e-9])}
    model = FixedRowsModel(rows, default=log_probs([0.2, 0.45, 0.35 - 1e-9, 1e-9]))
    config = DreamConfig(gen_length=4, steps=2, alg="maskgit_plus", temperature=0.0, top_p=None)
    result = run_decoder("dream", model, [0], config, mask_token_id=3, eos_token_id=None)
    assert [step.offsets for step in result.trace] == [[1], [0, 2, 3]]
    assert result.tokens == [0, 1, 1, 1]


def test_only_the_mask_in_the_nucleus_takes_the_best_other_token():
    """The mask is never written: a row whose top-p nucleus is the mask alone predicts its runner-up."""
    model = FixedRowsModel({}, default=log_probs([0.05, 0.1 - 1e-9, 0.05, 0.8 + 1e-9]))
    for temperature in (0.0, 1.0):
        config = DreamConfig(gen_length=4, steps=2, alg="maskgit_plus", temperature=temperature, top_p=0.5)
        result = run_decoder("dream", model, [0], config, mask_token_id=3, eos_token_id=None,
                             generator=torch.Generator().manual_seed(0))
        assert result.tokens == [1, 1, 1, 1]


def test_equal_confidences_go_leftmost_first():
    """torch.topk leaves the order of ties unspecified (the CPU's is not the GPU's); a decode must not."""
    model = FixedRowsModel({}, default=log_probs([0.7, 0.2, 0.1 - 1e-9, 1e-9]))
    config = DreamConfig(gen_length=8, steps=4, alg="maskgit_plus", temperature=0.0, top_p=None)
    result = run_decoder("dream", model, [0], config, mask_token_id=3, eos_token_id=None)
    assert [step.offsets for step in result.trace] == [[0], [1, 2], [3, 4], [5, 6, 7]]


def test_top_p_reads_the_running_sum_of_the_better_tokens_in_bf16():
    """bf16 probabilities 0.793, 0.108, 0.097, 0.004 (sorted) run to 0.793, 0.902, 0.996: at top_p 0.9
    the third goes (0.902 > 0.9), as the reference decides; 0.996 - 0.097 rounds to 0.899 in bf16."""
    logits = torch.tensor([[0.5703125, 0.458984375, 2.5625, -2.765625]], dtype=torch.bfloat16)
    assert torch.isfinite(filter_logits(logits, 0.9, None)).tolist() == [[True, False, True, False]]
