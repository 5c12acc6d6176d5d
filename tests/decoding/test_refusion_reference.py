"""The ReFusion decoder against the slow reference decoder (no cache, masks rebuilt from scratch)."""

from __future__ import annotations

import itertools

import pytest
import torch

from refusion_cli.decoding import ReFusionConfig, run_decoder
from tests.decoding.reference import CONFIGS, MODEL_SEEDS, ReferenceReFusion
from tests.tiny import MASK_ID

PROMPT_LENGTHS = [1, 9]


def run_both(model, prompt, config, eos_id, kv_reuse=True):
    result = run_decoder("refusion", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=eos_id,
                         kv_reuse=kv_reuse)
    reference = ReferenceReFusion(model, prompt, mask_id=MASK_ID, eos_id=eos_id, siblings_visible=not kv_reuse)
    expected = reference.decode(config.gen_length, config.slot_size, config.block_size,
                                config.slot_threshold, config.token_threshold)
    return result, expected, reference


def eos_inside(model, prompt, config):
    """A token the decoder commits mid-response when there is no EOS: used as EOS to force the EOS branches."""
    tokens = run_decoder("refusion", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=None).tokens
    return tokens[len(tokens) // 2]


@pytest.mark.parametrize("seed", [MODEL_SEEDS[0], *(pytest.param(seed, marks=pytest.mark.slow)
                                                    for seed in MODEL_SEEDS[1:])])  # each seed reaches every branch
def test_cached_decoder_matches_reference_token_for_token(models, seed):
    seen = {"fast_multi": 0, "completion_multi": 0, "eos_fast": 0, "eos_completion": 0, "replan": 0}
    cases = 0
    for (k, b, n, ts, tt), plen, use_eos in itertools.product(CONFIGS, PROMPT_LENGTHS, [False, True]):
        model = models[seed]
        prompt = torch.randint(0, MASK_ID - 2, (plen,), generator=torch.Generator().manual_seed(seed * 100 + plen)).tolist()
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)
        eos_id = eos_inside(model, prompt, config) if use_eos else None
        result, expected, reference = run_both(model, prompt, config, eos_id)
        assert result.tokens == expected, (seed, k, b, n, ts, tt, plen, eos_id)
        assert result.stats.forwards == reference.forwards  # one model call per reference pass
        cases += 1
        for step in result.trace:
            seen["fast_multi"] += step.path == "fast" and len(step.committed) > 1
            seen["completion_multi"] += step.path == "completion" and len(step.committed) > 1
            seen["eos_fast"] += step.path == "fast" and step.eos
            seen["eos_completion"] += step.path == "completion" and step.eos
            seen["replan"] += step.path == "fast" and len(step.committed) < len(step.chosen)
    assert cases == len(CONFIGS) * len(PROMPT_LENGTHS) * 2
    # the sweep is only meaningful if it went through every branch
    assert all(count > 0 for count in seen.values()), seen


def test_recompute_matches_reference_with_siblings_visible(models):
    """kv_reuse=False is plain causal attention over commit order: the reference with siblings visible."""
    for seed, (k, b, n, ts, tt) in itertools.product(MODEL_SEEDS, CONFIGS[:5]):
        prompt = list(range(3, 3 + 4 + seed))
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)
        result, expected, _ = run_both(models[seed], prompt, config, None, kv_reuse=False)
        assert result.tokens == expected


@pytest.mark.slow  # `make test-all`; by default the recheck test below runs causal_fix with the other two
def test_causal_fix_ablation_matches_reference_token_for_token(models):
    """causal_fix=True: the causal prediction replaces each forced completion token (an ablation)."""
    corrected = 0
    for seed, (k, b, n, ts, tt), use_eos in itertools.product(MODEL_SEEDS, CONFIGS, [False, True]):
        model, prompt = models[seed], list(range(2, 2 + 3 + seed))
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)
        eos_id = eos_inside(model, prompt, config) if use_eos else None
        result = run_decoder("refusion", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=eos_id,
                             causal_fix=True)
        reference = ReferenceReFusion(model, prompt, mask_id=MASK_ID, eos_id=eos_id)
        expected = reference.decode(config.gen_length, config.slot_size, config.block_size,
                                    config.slot_threshold, config.token_threshold, causal_fix=True)
        assert result.tokens == expected, (seed, k, b, n, ts, tt, eos_id)
        kinds = [kind for step in result.trace for kind in step.kinds]
        assert "forced" not in kinds
        corrected += kinds.count("corrected")
    assert corrected > 0  # the sweep went through the replacement


@pytest.mark.slow  # `make test-all`; by default the recheck test below runs causal_first with the other two
@pytest.mark.parametrize("causal_fix", [False, True])
def test_causal_first_ablation_matches_reference_token_for_token(models, causal_fix):
    """causal_first=True: a chosen slot whose left neighbour is committed starts with the causal head's
    token from the pass that committed that neighbour when it is at least as sure of it as the draft head of
    the draft; alone and with causal_fix, in the same forwards."""
    taken = replaced = kept = 0
    for seed, (k, b, n, ts, tt), use_eos in itertools.product(MODEL_SEEDS, CONFIGS, [False, True]):
        model, prompt = models[seed], list(range(2, 2 + 1 + 4 * seed))  # 1, 5 and 9 tokens
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)
        eos_id = eos_inside(model, prompt, config) if use_eos else None
        result = run_decoder("refusion", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=eos_id,
                             causal_fix=causal_fix, causal_first=True)
        reference = ReferenceReFusion(model, prompt, mask_id=MASK_ID, eos_id=eos_id)
        expected = reference.decode(config.gen_length, config.slot_size, config.block_size, config.slot_threshold,
                                    config.token_threshold, causal_fix=causal_fix, causal_first=True)
        assert result.tokens == expected, (seed, k, b, n, ts, tt, eos_id)
        assert result.stats.forwards == reference.forwards  # the causal token costs no pass
        kinds = [kind for step in result.trace for kind in step.kinds]
        if causal_fix:
            assert "forced" not in kinds
        taken += kinds.count("causal-first")
        replaced += reference.replaced_firsts
        kept += reference.kept_drafts
    assert taken > 0 and replaced > 0  # slots started with the causal token, and it differed from the draft
    assert kept > 0  # and slots after a committed neighbour kept a draft that was the surer one


@pytest.mark.parametrize("options, seed", [
    *(pytest.param({}, seed, marks=pytest.mark.slow) for seed in MODEL_SEEDS),  # `make test-all`
    ({"causal_fix": True, "causal_first": True}, MODEL_SEEDS[0]),
    *(pytest.param({"causal_fix": True, "causal_first": True}, seed, marks=pytest.mark.slow)
      for seed in MODEL_SEEDS[1:])])  # each seed sends rows back (10, 13 and 22 of them)
def test_recheck_ablation_matches_reference_token_for_token(models, options, seed):
    """recheck=True: the completed rows are verified again together and only those up to the first failing
    token are committed; alone and with the other two ablations, in the same forwards."""
    sent_back = 0
    for (k, b, n, ts, tt), use_eos in itertools.product(CONFIGS, [False, True]):
        model, prompt = models[seed], list(range(2, 2 + 1 + 4 * seed))
        config = ReFusionConfig(gen_length=n, slot_size=k, block_size=b, slot_threshold=ts, token_threshold=tt)
        eos_id = eos_inside(model, prompt, config) if use_eos else None
        result = run_decoder("refusion", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=eos_id,
                             recheck=True, **options)
        reference = ReferenceReFusion(model, prompt, mask_id=MASK_ID, eos_id=eos_id)
        expected = reference.decode(config.gen_length, config.slot_size, config.block_size, config.slot_threshold,
                                    config.token_threshold, recheck=True, **options)
        assert result.tokens == expected, (seed, k, b, n, ts, tt, eos_id)
        assert result.stats.forwards == reference.forwards
        sent_back += reference.rechecked_away
    assert sent_back > 0  # the sweep went through rows the recheck returned to the plan
