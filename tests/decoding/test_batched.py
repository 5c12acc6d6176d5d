"""Batched decoding: every row of a batch decodes exactly as its prompt alone (tokens, forwards, trace).

Rows of one batch take different paths (fast commit, completion, EOS early, late or never), have
prompts of different lengths, and join a running batch when a row finishes (batch_size below the
number of prompts) or leave it without replacement (batch_size above the prompts left).
"""

from __future__ import annotations

import pytest
import torch

from refusion_cli.decoding import ARConfig, DreamConfig, LLaDAConfig, ReFusionConfig, run_decoder
from refusion_cli.decoding.engine import Engine
from refusion_cli.errors import UserError
from tests.decoding.conftest import greedy
from tests.decoding.reference import CONFIGS, MODEL_SEEDS
from tests.tiny import MASK_ID, tiny_qwen3

PROMPT_LENGTHS = [1, 9, 4, 6, 2]


def prompts_for(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK_ID - 2, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def eos_ids_for(free: list[list[int]]) -> tuple[int, ...]:
    """Two EOS ids: one from early in the first row's free answer, one from late in the second's."""
    return free[0][len(free[0]) // 4], free[1][-2]


def same_as_alone(batched, alone) -> None:
    assert len(batched) == len(alone)
    for row, (got, expected) in enumerate(zip(batched, alone)):
        assert got.tokens == expected.tokens, row
        assert got.stats.tokens == expected.stats.tokens, row
        assert got.stats.forwards == expected.stats.forwards, row
        assert got.stats.positions == expected.stats.positions, row
        assert got.trace == expected.trace, row


@pytest.mark.parametrize("seed", [MODEL_SEEDS[0], *(pytest.param(seed, marks=pytest.mark.slow)
                                                    for seed in MODEL_SEEDS[1:])])  # each seed reaches every branch
def test_refusion_rows_decode_as_alone_over_the_reference_sweep(models, seed):
    seen = {"fast_multi": 0, "completion_multi": 0, "eos_fast": 0, "eos_completion": 0, "eos_early": 0,
            "eos_late": 0, "no_eos": 0}
    for k, b, n, ts, tt in CONFIGS:
        model, prompts = models[seed], prompts_for(seed)
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)

        def decode(prompt_ids, eos, **options):
            return run_decoder("refusion", model, prompt_ids, config, mask_token_id=MASK_ID, eos_token_id=eos,
                               **options)

        eos = eos_ids_for([decode(p, None).tokens for p in prompts])
        alone = [decode(p, eos) for p in prompts]
        for batch_size in (None, 2, len(prompts) + 3):
            same_as_alone(decode(prompts, eos, batch_size=batch_size), alone)
        for result in alone:
            ended = result.tokens[-1] in eos
            seen["no_eos"] += not ended
            seen["eos_early"] += ended and len(result.tokens) <= n // 2
            seen["eos_late"] += ended and len(result.tokens) > n // 2
            for step in result.trace:
                seen["fast_multi"] += step.path == "fast" and len(step.committed) > 1
                seen["completion_multi"] += step.path == "completion" and len(step.committed) > 1
                seen["eos_fast"] += step.path == "fast" and step.eos
                seen["eos_completion"] += step.path == "completion" and step.eos
    assert all(count > 0 for count in seen.values()), seen


SLOW = pytest.mark.slow  # `make test-all`: the rest of an exhaustive sweep; one representative case runs by default


ALL_VARIANTS = {"recheck": True, "causal_fix": True, "causal_first": True}


@pytest.mark.parametrize("options, seed", [
    *(pytest.param(options, seed, marks=SLOW) for options in (
        {"kv_reuse": False}, {"causal_fix": True}, {"causal_first": True}, {"causal_first": True, "causal_fix": True},
        {"causal_first": True, "kv_reuse": False}, {"recheck": True}) for seed in MODEL_SEEDS[:2]),
    (ALL_VARIANTS, MODEL_SEEDS[0]), pytest.param(ALL_VARIANTS, MODEL_SEEDS[1], marks=SLOW)])
def test_refusion_ablations_batch_as_alone(models, options, seed):
    # two of the model seeds: the full sweep runs the paper's decoder over all three
    for k, b, n, ts, tt in CONFIGS[:5]:
        model, prompts = models[seed], prompts_for(seed)
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)
        eos = eos_ids_for([run_decoder("refusion", model, p, config, mask_token_id=MASK_ID, eos_token_id=None,
                                       **options).tokens for p in prompts])
        alone = [run_decoder("refusion", model, p, config, mask_token_id=MASK_ID, eos_token_id=eos, **options)
                 for p in prompts]
        batched = run_decoder("refusion", model, prompts, config, mask_token_id=MASK_ID, eos_token_id=eos,
                              batch_size=3, **options)
        same_as_alone(batched, alone)


def test_refusion_rows_draw_from_their_own_generators(models):
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.3, token_threshold=0.3,
                            temperature=1.0)
    prompts = prompts_for(0)
    alone = [run_decoder("refusion", models[0], p, config, mask_token_id=MASK_ID, eos_token_id=None,
                         generator=torch.Generator().manual_seed(row)) for row, p in enumerate(prompts)]
    batched = run_decoder("refusion", models[0], prompts, config, mask_token_id=MASK_ID, eos_token_id=None,
                          batch_size=2, generator=[torch.Generator().manual_seed(row) for row in range(len(prompts))])
    same_as_alone(batched, alone)
    with pytest.raises(UserError, match="2 generators for 5 prompts"):
        run_decoder("refusion", models[0], prompts, config, mask_token_id=MASK_ID, eos_token_id=None,
                    generator=[torch.Generator(), torch.Generator()])


@pytest.mark.parametrize("max_new", [pytest.param(1, marks=SLOW), pytest.param(12, marks=SLOW), 30])  # 30: every end
def test_ar_rows_decode_as_alone(models, max_new):
    lengths = []
    for seed in MODEL_SEEDS:
        model, prompts = models[seed], prompts_for(seed)
        eos = eos_ids_for([greedy(model, p, 30, None).tokens for p in prompts])
        alone = [greedy(model, p, max_new, eos) for p in prompts]
        for batch_size in (None, 2, len(prompts) + 3):
            same_as_alone(greedy(model, prompts, max_new, eos, batch_size=batch_size), alone)
        lengths += [len(result.tokens) for result in alone]
    if max_new == 30:  # the EOS ids end some rows early, some late, and leave others running to the budget
        assert min(lengths) <= 10 and max(lengths) == 30 and any(15 < n < 30 for n in lengths), lengths


def test_finished_rows_leave_the_batch_and_waiting_prompts_take_their_place(models, record_calls):
    model, prompts = models[0], prompts_for(0)
    free = [greedy(model, p, 30, None).tokens for p in prompts]
    eos = eos_ids_for(free)
    alone = [greedy(model, p, 30, eos) for p in prompts]
    for batch_size in (None, 2):
        calls = record_calls(model)
        engine = Engine(model, max_rows=batch_size)
        rows: list[int] = []
        engine.on_call = rows.append
        batched = run_decoder("ar", model, prompts, ARConfig(gen_length=30), mask_token_id=None, eos_token_id=eos,
                              engine=engine)
        same_as_alone(batched, alone)
        limit = batch_size or len(prompts)
        assert max(rows) == limit and rows[-1] == 1  # the last row decodes alone at the end
        # a row costs compute only while it runs: the calls' rows sum to the rows' own forwards
        assert sum(rows) == sum(result.stats.forwards for result in batched) == sum(len(r.tokens) for r in alone)
        if batch_size == 2:  # refilled: never more calls than decoding the rows two by two in lockstep
            assert len(calls) < sum(r.stats.forwards for r in alone)
        # one packed sequence a call, no padding: a prompt's first call feeds its prompt, every later call one
        # token of each running row, and the calls compute exactly those tokens
        assert all(call.shape[0] == 1 for call in calls)
        assert sum(call.shape[1] for call in calls) == sum(len(p) + len(r.tokens) - 1 for p, r in zip(prompts, alone))


def test_batch_of_one_is_the_single_decode(models):
    model, prompts = models[1], prompts_for(1)
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.3, token_threshold=0.3)
    single = run_decoder("refusion", model, prompts[1], config, mask_token_id=MASK_ID, eos_token_id=None)
    (row,) = run_decoder("refusion", model, [prompts[1]], config, mask_token_id=MASK_ID, eos_token_id=None)
    assert row.tokens == single.tokens and row.stats.forwards == single.stats.forwards
    assert row.stats.seconds > 0


def test_on_step_of_a_batch_names_the_prompt(models):
    model, prompts = models[2], prompts_for(2)
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.3, token_threshold=0.3)
    seen: dict[int, list] = {}
    results = run_decoder("refusion", model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None, batch_size=3,
                          on_step=lambda index, step: seen.setdefault(index, []).append(step))
    assert seen == {index: result.trace for index, result in enumerate(results)}


def test_bad_batch_size_is_refused(models):
    with pytest.raises(UserError, match="batch_size must be a positive integer"):
        greedy(models[0], [[1, 2], [3]], 4, None, batch_size=0)


def test_run_decoder_takes_a_batch_for_every_decoder(models, bidirectional_model):
    from refusion_cli.decoding.config import ARConfig

    prompts = prompts_for(0)
    cases = [
        ("refusion", models[0], ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.3,
                                               token_threshold=0.3)),
        ("ar", models[0], ARConfig(gen_length=12)),
        ("llada", bidirectional_model, LLaDAConfig(gen_length=8, steps=4, block_length=8)),
    ]
    for decoder, model, config in cases:
        alone = [run_decoder(decoder, model, p, config, mask_token_id=MASK_ID, eos_token_id=None) for p in prompts]
        batched = run_decoder(decoder, model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None, batch_size=2)
        same_as_alone(batched, alone)
        assert all(result.stats.seconds > 0 for result in batched), decoder


# ---------------------------------------------------------------------------------------------
# LLaDA and Dream: rows of canvases packed in shared calls, each with its own cache

# cache: None, "prefix" (use_cache) or "dual" (use_cache and dual_cache)
LLADA_SWEEP = [  # gen_length, steps, block_length, threshold, cache, cfg_scale, remasking, temperature
    (16, 16, 8, None, None, 0.0, "low_confidence", 0.0),
    (16, 6, 8, None, "prefix", 0.0, "low_confidence", 0.0),
    (24, 12, 8, 0.3, None, 0.0, "low_confidence", 0.0),
    (24, 24, 24, 0.3, "prefix", 0.0, "low_confidence", 0.0),
    (16, 8, 16, None, None, 1.5, "low_confidence", 0.0),
    (16, 8, 8, 0.5, "dual", 1.0, "low_confidence", 0.0),
    (16, 8, 8, None, "prefix", 0.0, "random", 1.0),
]
DREAM_SWEEP = [  # gen_length, steps, alg, block_length, threshold, cache, temperature
    (16, 8, "entropy", None, None, None, 0.0),
    (16, 16, "maskgit_plus", 8, None, "prefix", 0.0),
    (24, 6, "topk_margin", 8, 0.3, None, 0.0),
    (24, 24, "entropy", 8, 0.3, "prefix", 0.0),
    (16, 4, "maskgit_plus", 8, 0.3, "dual", 0.0),
    (16, 8, "origin", None, None, None, 1.0),
    (16, 8, "origin", 8, None, "dual", 0.0),
    (16, 16, "maskgit_plus", 16, 0.5, "prefix", 0.7),
]
MDM_SEEDS = [0, 1]


@pytest.fixture(scope="module")
def mdm_models():
    return {seed: tiny_qwen3(seed, causal=False, init_std=0.5) for seed in MDM_SEEDS}


def llada_config(case) -> LLaDAConfig:
    n, steps, block, threshold, cache, cfg, remasking, temperature = case
    return LLaDAConfig(gen_length=n, steps=steps, block_length=block, threshold=threshold, use_cache=cache is not None,
                       dual_cache=cache == "dual", cfg_scale=cfg, remasking=remasking, temperature=temperature)


def dream_config(case) -> DreamConfig:
    n, steps, alg, block, threshold, cache, temperature = case
    return DreamConfig(gen_length=n, steps=steps, alg=alg, block_length=block, threshold=threshold,
                       use_cache=cache is not None, dual_cache=cache == "dual", temperature=temperature,
                       top_p=0.9 if temperature else None)


def row_generators_for(count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + row) for row in range(count)]


def mdm_rows_decode_as_alone(decoder, models, configs, seed) -> dict[str, int]:
    """Every row of every batch size equals its batch-1 decode; returns what the sweep reached."""
    seen = {"eos_early": 0, "eos_late": 0, "no_eos": 0, "parallel_step": 0, "several_blocks": 0, "cache": 0,
            "dual_cache": 0, "threshold": 0}
    for config in configs:
        model, prompts = models[seed], prompts_for(seed)

        def decode(prompt_ids, eos, **options):
            generator = row_generators_for(len(prompt_ids)) if isinstance(prompt_ids[0], list) else \
                torch.Generator().manual_seed(100 + prompts.index(prompt_ids))
            return run_decoder(decoder, model, prompt_ids, config, mask_token_id=MASK_ID, eos_token_id=eos,
                               generator=generator, **options)

        eos = eos_ids_for([decode(p, None).tokens for p in prompts])
        alone = [decode(p, eos) for p in prompts]
        for batch_size in (None, 2, len(prompts) + 3):
            same_as_alone(decode(prompts, eos, batch_size=batch_size), alone)
        n = config.gen_length
        seen["cache"] += config.use_cache
        seen["dual_cache"] += config.dual_cache
        seen["threshold"] += config.threshold is not None
        for result in alone:
            ended = result.tokens[-1] in eos
            seen["no_eos"] += not ended
            seen["eos_early"] += ended and len(result.tokens) <= n // 2
            seen["eos_late"] += ended and len(result.tokens) > n // 2
            seen["parallel_step"] += any(len(step.offsets) > 1 for step in result.trace)
            seen["several_blocks"] += len({step.block for step in result.trace}) > 1
    return seen


def mdm_seed_cases(default: int) -> list:
    """By default the seed whose sweep alone reaches every case (``seen``); the other under ``make test-all``."""
    return [default, *(pytest.param(seed, marks=SLOW) for seed in MDM_SEEDS if seed != default)]


@pytest.mark.parametrize("seed", mdm_seed_cases(1))  # seed 0's LLaDA rows never end late
def test_llada_rows_decode_as_alone_over_a_sweep(mdm_models, seed):
    seen = mdm_rows_decode_as_alone("llada", mdm_models, [llada_config(case) for case in LLADA_SWEEP], seed)
    assert all(count > 0 for count in seen.values()), seen


@pytest.mark.parametrize("seed", mdm_seed_cases(0))
def test_dream_rows_decode_as_alone_over_a_sweep(mdm_models, seed):
    configs = [dream_config(case) for case in DREAM_SWEEP]
    assert {config.alg for config in configs} == {"origin", "maskgit_plus", "topk_margin", "entropy"}
    seen = mdm_rows_decode_as_alone("dream", mdm_models, configs, seed)
    assert all(count > 0 for count in seen.values()), seen


@pytest.mark.parametrize("decoder", ["llada", "dream"])
def test_mdm_rows_share_calls_and_finished_rows_leave(mdm_models, record_calls, decoder):
    """With a threshold the rows take different numbers of steps: a finished row leaves the calls,
    a waiting prompt joins, and each call holds one row per running prompt (its canvas, unpadded)."""
    model, prompts = mdm_models[0], prompts_for(0)
    if decoder == "llada":
        config = LLaDAConfig(gen_length=16, steps=16, block_length=8, threshold=0.3)
    else:
        config = DreamConfig(gen_length=16, steps=2, alg="entropy", temperature=0.0, top_p=None, threshold=0.3)
    alone = [run_decoder(decoder, model, p, config, mask_token_id=MASK_ID, eos_token_id=None) for p in prompts]
    forwards = [result.stats.forwards for result in alone]
    assert len(set(forwards)) > 1, forwards  # rows finish at different times
    for batch_size in (None, 2):
        calls = record_calls(model)
        rows: list[int] = []  # the rows of each model call
        engine = Engine(model, max_rows=batch_size)
        engine.on_call = rows.append
        batched = run_decoder(decoder, model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None,
                              batch_size=batch_size, engine=engine)
        same_as_alone(batched, alone)
        assert max(rows) == (batch_size or len(prompts))
        assert sum(rows) == sum(forwards)  # a row takes part in exactly its own forwards
        # no padding: the calls compute each row's canvas, whole, at each of its forwards
        assert sum(call.numel() for call in calls) == sum(n * (len(p) + config.gen_length)
                                                          for n, p in zip(forwards, prompts))
        if batch_size is None:  # lockstep: a row leaves after its last step, the longest decode ends alone
            assert rows == [sum(n > call for n in forwards) for call in range(max(forwards))]
        else:  # refilled: fewer calls than decoding the rows two by two in lockstep
            assert len(calls) < sum(max(pair) for pair in zip(forwards[::2], forwards[1::2] + [0]))
        calls.clear()


def test_mdm_on_step_of_a_batch_names_the_prompt(mdm_models):
    model, prompts = mdm_models[1], prompts_for(1)
    config = LLaDAConfig(gen_length=16, steps=8, block_length=8, threshold=0.4, use_cache=True)
    seen: dict[int, list] = {}
    results = run_decoder("llada", model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None, batch_size=3,
                          on_step=lambda index, step: seen.setdefault(index, []).append(step))
    assert seen == {index: result.trace for index, result in enumerate(results)}
    greedy_dream = DreamConfig(gen_length=8, steps=4, temperature=0.0, top_p=None)
    (row,) = run_decoder("dream", model, [prompts[2]], greedy_dream, mask_token_id=MASK_ID, eos_token_id=None)
    single = run_decoder("dream", model, prompts[2], greedy_dream, mask_token_id=MASK_ID, eos_token_id=None)
    assert row.tokens == single.tokens and row.trace == single.trace
    with pytest.raises(UserError, match="2 generators for 5 prompts"):
        run_decoder("llada", model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None,
                    generator=[torch.Generator(), torch.Generator()])


def test_run_decoder_batches_llada_and_dream(mdm_models):
    model, prompts = mdm_models[0], prompts_for(0)
    for decoder, config in [("llada", LLaDAConfig(gen_length=16, steps=8, block_length=8, use_cache=True)),
                            ("dream", DreamConfig(gen_length=16, steps=8, temperature=0.0, top_p=None))]:
        alone = [run_decoder(decoder, model, p, config, mask_token_id=MASK_ID, eos_token_id=None) for p in prompts]
        engine = Engine(model, max_rows=2)
        batched = run_decoder(decoder, model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None,
                              batch_size=2, engine=engine)
        same_as_alone(batched, alone)
        assert engine.counts.peak_rows == 2, decoder  # two rows a call, not prompt by prompt
