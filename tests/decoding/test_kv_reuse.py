"""kv_reuse=True (the paper's KV reuse) against kv_reuse=False (its recompute ablation)."""

from __future__ import annotations

import itertools

import torch

from refusion_cli.decoding import ReFusionConfig, run_decoder
from tests.decoding.reference import ReferenceReFusion
from tests.tiny import MASK_ID, tiny_qwen3


def decode(model, prompt, config, kv_reuse):
    return run_decoder("refusion", model, prompt, config, mask_token_id=MASK_ID, eos_token_id=None,
                       kv_reuse=kv_reuse)


def multi_slot_completion(result) -> bool:
    return any(step.path == "completion" and len(step.committed) > 1 for step in result.trace)


def test_same_tokens_unless_a_completion_committed_several_slots():
    agreeing = differing = 0
    for seed, (ts, tt) in itertools.product(range(4), [(0.9, 0.9), (0.0, 0.0), (0.3, 0.3), (0.0, 0.5), (0.5, 0.05)]):
        model = tiny_qwen3(seed, init_std=0.6)
        prompt = list(range(5, 12))
        config = ReFusionConfig(gen_length=24, slot_size=4, block_size=12, slot_threshold=ts, token_threshold=tt)
        reuse, recompute = decode(model, prompt, config, True), decode(model, prompt, config, False)
        # same number of model calls, strictly more positions computed when recomputing
        assert recompute.stats.forwards == reuse.stats.forwards or multi_slot_completion(reuse)
        assert recompute.stats.positions > reuse.stats.positions
        if not multi_slot_completion(reuse):
            assert recompute.tokens == reuse.tokens
            assert recompute.stats.forwards == reuse.stats.forwards
            agreeing += 1
        elif recompute.tokens != reuse.tokens:
            differing += 1
    assert agreeing > 0


def test_where_they_differ_and_why():
    """After a completion step commits slots A and B side by side, B's reused K/V never saw A.

    With KV reuse, every later pass attends to B's K/V as computed in B's own row; recomputing
    (kv_reuse=False) runs A and B plain causal in commit order, so B now sees A and its K/V, and
    everything decoded after it, can change. The reference decoder reproduces both behaviours:
    siblings hidden = kv_reuse=True, siblings visible = kv_reuse=False.
    """
    model = tiny_qwen3(0, init_std=0.6)
    prompt = [7, 3, 9, 4]
    # three blocks of two slots; every slot is chosen and every block goes through one completion step
    config = ReFusionConfig(gen_length=24, slot_size=4, block_size=8, slot_threshold=0.0, token_threshold=0.9)
    reuse, recompute = decode(model, prompt, config, True), decode(model, prompt, config, False)
    assert reuse.tokens != recompute.tokens
    # the first iteration is a completion that commits every chosen slot at once ...
    first = reuse.trace[0]
    assert first.path == "completion" and len(first.committed) > 1
    # ... and its slots' tokens agree in both modes: rows never see each other while being completed
    first_offsets = first.offsets
    assert [reuse.tokens[o] for o in first_offsets] == [recompute.tokens[o] for o in first_offsets]
    # the difference comes from the reused K/V alone: the reference reproduces each side exactly
    for siblings_visible, result in [(False, reuse), (True, recompute)]:
        reference = ReferenceReFusion(model, prompt, mask_id=MASK_ID, eos_id=None, siblings_visible=siblings_visible)
        assert reference.decode(config.gen_length, config.slot_size, config.block_size,
                                config.slot_threshold, config.token_threshold) == result.tokens


def test_recompute_feeds_the_whole_context_every_pass():
    model = tiny_qwen3(0, init_std=0.6)
    prompt = list(range(1, 10))
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=16, slot_threshold=0.0, token_threshold=0.0)
    reuse, recompute = decode(model, prompt, config, True), decode(model, prompt, config, False)
    # thresholds 0: one plan + one verify commits the whole block; the prompt rides along with the plan
    assert reuse.stats.forwards == recompute.stats.forwards == 2
    assert reuse.stats.positions == (9 + 16) + 16
    assert recompute.stats.positions == (9 + 16) + (9 + 16)
    assert reuse.tokens == recompute.tokens


def test_only_the_fed_tokens_logits_are_computed(causal_model, prompt, record_calls):
    """The prompt and recomputed context get K/V but no logits: the LM head sees only the new tokens."""
    from tests.decoding.conftest import greedy

    head_rows: list[int] = []
    handle = causal_model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(out.shape[1]))
    try:
        # blocks of 8 = two slots of 4: no call feeds more than 8 new tokens
        config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.5, token_threshold=0.5)
        for kv_reuse in (True, False):
            head_rows.clear()
            calls = record_calls(causal_model)
            decode(causal_model, prompt, config, kv_reuse)
            fed = [call.shape[1] for call in calls]
            assert len(head_rows) == len(fed) > 2
            assert (fed[0], head_rows[0]) == (len(prompt) + 8, 8)  # the first plan carries the prompt along
            assert max(head_rows) <= 8
            if not kv_reuse:
                assert all(length > rows for rows, length in zip(head_rows, fed))  # the context is always re-fed
        head_rows.clear()
        greedy(causal_model, prompt, 8, None)
        assert head_rows == [1] * 8  # the prefill's too: only its last position
    finally:
        handle.remove()
