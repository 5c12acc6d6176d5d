"""Every branch of the ReFusion decoder, forced with a scripted model whose probabilities the test sets."""

from __future__ import annotations

import pytest
import torch

from refusion_cli.decoding import ConfigError, ReFusionConfig, run_decoder
from tests.decoding.scripted import EOS, MASK, ScriptedModel

PROMPT = [1, 2, 3]  # what run() feeds a 3-token prompt model


def truth_of(n: int) -> list[int]:
    return [1 + (i * 5) % 13 for i in range(n)]  # ids 1..13: never EOS (14) or MASK (15)


def run(model, config, eos=EOS):
    prompt = [1 + i % 10 for i in range(model.prompt_len)]
    return run_decoder("refusion", model, prompt, config, mask_token_id=MASK, eos_token_id=eos)


def fed_positions(model, call):
    return [p - model.prompt_len for p in model.calls[call][1]]


def test_fast_path_commits_several_slots_in_one_iteration():
    truth = truth_of(16)
    model = ScriptedModel(3, truth)
    result = run(model, ReFusionConfig(gen_length=16, slot_size=4, block_size=16, slot_threshold=0.9, token_threshold=0.9))
    assert result.tokens == truth
    assert [(s.path, s.chosen, s.committed) for s in result.trace] == [("fast", [0, 1, 2, 3], [0, 1, 2, 3])]
    assert result.trace[0].kinds == ["first", "verified", "verified", "verified"] * 4
    assert result.stats.forwards == 2  # one plan (with the prompt), one verification
    assert fed_positions(model, 0) == [-3, -2, -1] + list(range(16))


def test_partial_prefix_commits_whole_slots_and_replans_the_rest():
    truth = truth_of(16)
    # token 6 (slot 1) fails verification in the first pass only: slot 0 is committed, slots 1-3 re-planned
    model = ScriptedModel(3, truth, ar={6: 0.5})
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=16, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    first, second = result.trace[0], result.trace[1]
    assert (first.path, first.chosen, first.committed, first.accepted_prefix) == ("fast", [0, 1, 2, 3], [0], 6)
    assert first.kinds == ["first", "verified", "verified", "verified"]  # only the whole slot inside the prefix
    assert second.chosen == [1, 2, 3]
    assert fed_positions(model, 2) == list(range(4, 16))  # the re-plan feeds only the masked slots
    assert result.tokens == truth


def test_parallel_completion_when_no_whole_slot_is_accepted():
    truth = truth_of(8)
    # token 1 fails verification; in the completion it is forced, token 2 fails once more and is forced next round
    model = ScriptedModel(3, truth, ar={1: 0.5, 2: 0.5, 5: 0.5})
    config = ReFusionConfig(gen_length=8, slot_size=4, block_size=8, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    assert result.tokens == truth
    (step,) = result.trace
    assert (step.path, step.chosen, step.committed, step.accepted_prefix, step.rounds) == (
        "completion", [0, 1], [0, 1], 1, 2)
    assert result.stats.forwards == 2 + 2 * 2  # plan + verify, then (draft + verify) per round
    # tokens 1, 2 and 5 failed their check and went in as the one forced token of a round
    assert step.kinds == ["first", "forced", "forced", "verified", "first", "forced", "verified", "verified"]
    # round 1 drafts every unaccepted token of both rows, side by side in one call
    assert model.calls[2][0] == [truth[0], MASK, MASK, MASK, truth[4], MASK, MASK, MASK]


def test_completion_redrafts_tokens_the_plan_got_wrong():
    truth = truth_of(4)
    model = ScriptedModel(3, truth, wrong={0: {2: 13, 3: 13}})  # the plan pass drafts 13 at offsets 2 and 3
    result = run(model, ReFusionConfig(gen_length=4, slot_size=4, block_size=4, slot_threshold=0.9, token_threshold=0.9))
    assert result.trace[0].path == "completion" and result.trace[0].accepted_prefix == 2
    assert model.calls[1][0] == [truth[0], truth[1], 13, 13]  # verification sees the wrong drafts
    assert result.tokens == truth  # the completion's draft pass replaced them
    assert result.trace[0].kinds == ["first", "verified", "verified", "verified"]  # the re-drafts passed the check


def test_causal_fix_replaces_the_forced_token_with_the_causal_prediction():
    truth = truth_of(4)
    config = ReFusionConfig(gen_length=4, slot_size=4, block_size=4, slot_threshold=0.9, token_threshold=0.9)
    # the plan drafts 13 at offset 1 and so does the completion's draft pass (call 2): verification rejects it
    wrong = {0: {1: 13}, 2: {1: 13}}
    faithful = run(ScriptedModel(3, truth, wrong=wrong), config)
    assert faithful.tokens == [truth[0], 13, *truth[2:]]  # forced in, as the reference decoder does
    assert faithful.trace[0].kinds == ["first", "forced", "verified", "verified"]
    model = ScriptedModel(3, truth, wrong=wrong)
    fixed = run_decoder("refusion", model, [1, 2, 3], config, mask_token_id=MASK, eos_token_id=EOS, causal_fix=True)
    assert fixed.tokens == truth  # the causal head's token instead
    assert fixed.trace[0].kinds == ["first", "corrected", "verified", "verified"]
    # plan + verify, round 1 (draft + verify: token 1 replaced, 2-3 not accepted), round 2 (draft + verify)
    assert fixed.stats.forwards == faithful.stats.forwards + 2 == 6
    assert model.calls[-1][0] == truth  # the last call, whose K/V is committed, holds the final tokens


def test_causal_fix_in_the_last_round_recomputes_the_rows():
    truth = truth_of(4)
    config = ReFusionConfig(gen_length=4, slot_size=4, block_size=4, slot_threshold=0.9, token_threshold=0.9)
    wrong = {0: {3: 13}, 2: {3: 13}}  # only the last token is wrong: its replacement ends the completion
    model = ScriptedModel(3, truth, wrong=wrong)
    fixed = run_decoder("refusion", model, [1, 2, 3], config, mask_token_id=MASK, eos_token_id=EOS, causal_fix=True)
    assert fixed.tokens == truth and fixed.trace[0].rounds == 1
    assert fixed.stats.forwards == 2 + 2 + 1  # one more pass for the K/V of the replaced token
    assert model.calls[-1][0] == truth


def test_causal_first_takes_the_causal_token_after_a_committed_neighbour():
    truth = truth_of(8)
    config = ReFusionConfig(gen_length=8, slot_size=4, block_size=8, slot_threshold=0.9, token_threshold=0.9)
    # the plan drafts 13 where slot 0 starts (call 0, probability 0.95) and where slot 1 starts (call 2, after
    # slot 0 is committed; 0.5, so it waits for the second plan); the causal head is surer of the truth (0.99)
    wrong, plan = {0: {0: 13}, 2: {4: 13}}, {0: 0.95, 4: 0.5}
    faithful = run(ScriptedModel(3, truth, plan=plan, wrong=wrong), config)
    assert faithful.tokens == [13, *truth[1:4], 13, *truth[5:]]  # the draft's first tokens, as the paper commits
    assert [step.kinds[0] for step in faithful.trace] == ["first", "first"]
    model = ScriptedModel(3, truth, plan=plan, wrong=wrong)
    fixed = run_decoder("refusion", model, PROMPT, config, mask_token_id=MASK, eos_token_id=EOS, causal_first=True)
    # slot 0: the last prompt token's prediction (first call); slot 1: that of offset 3, from slot 0's verification
    assert fixed.tokens == truth
    assert [step.kinds for step in fixed.trace] == [["causal-first", "verified", "verified", "verified"]] * 2
    assert fixed.stats.forwards == faithful.stats.forwards == 4  # plan + verify per slot: no extra pass
    assert model.calls[1][0] == truth[:4] and model.calls[3][0] == truth[4:]  # verified after the causal token


def test_causal_first_keeps_a_draft_that_is_surer_than_the_causal_head():
    truth = truth_of(8)
    config = ReFusionConfig(gen_length=8, slot_size=4, block_size=4, slot_threshold=0.9, token_threshold=0.9)
    # one slot per block: slot 1 is planned (call 2) after slot 0 is committed, and drafts 13 with 0.99; the
    # causal head gives the truth at offset 4 only 0.6, so the draft stays; slot 0 takes the causal token
    # (0.99 against the draft's 0.95)
    model = ScriptedModel(3, truth, plan={0: 0.95}, ar={4: 0.6}, wrong={2: {4: 13}})
    result = run_decoder("refusion", model, PROMPT, config, mask_token_id=MASK, eos_token_id=EOS, causal_first=True)
    assert result.tokens == [*truth[:4], 13, *truth[5:]]
    assert [step.kinds[0] for step in result.trace] == ["causal-first", "first"]


def test_causal_first_keeps_the_draft_where_the_left_neighbour_is_masked():
    truth = truth_of(8)
    config = ReFusionConfig(gen_length=8, slot_size=4, block_size=8, slot_threshold=0.9, token_threshold=0.9)
    model = ScriptedModel(3, truth, wrong={0: {4: 13}})  # both slots chosen by the first plan; slot 1 starts wrong
    result = run_decoder("refusion", model, PROMPT, config, mask_token_id=MASK, eos_token_id=EOS, causal_first=True)
    assert result.tokens == [*truth[:4], 13, *truth[5:]]  # offset 3 was not committed when slot 1 was planned
    (step,) = result.trace
    assert step.kinds == ["causal-first", "verified", "verified", "verified", "first", "verified", "verified",
                          "verified"]


def test_eos_inside_the_verified_prefix_ends_the_response():
    truth = truth_of(24)
    truth[6] = EOS
    model = ScriptedModel(3, truth)
    config = ReFusionConfig(gen_length=24, slot_size=4, block_size=12, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    assert result.tokens == truth[:7]
    (step,) = result.trace  # slot 2 is discarded and the second block never runs
    assert (step.path, step.committed, step.eos) == ("fast", [0, 1], True)
    assert step.offsets == list(range(7))
    assert result.stats.forwards == 2 and result.stats.tokens == 7


@pytest.mark.parametrize("path", ["fast", "completion"])
def test_any_of_several_eos_ids_ends_the_response(path):
    """A second EOS id (Qwen3's <|endoftext|> next to <|im_end|>) ends a response as the first one does."""
    truth = truth_of(24)
    other = truth[6]  # 5: not in truth[:6]
    assert other not in truth[:6]
    model = ScriptedModel(3, truth, ar={5: 0.5} if path == "completion" else {})
    config = ReFusionConfig(gen_length=24, slot_size=4, block_size=12, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config, eos=(EOS, other))
    assert result.tokens == truth[:7] and result.stats.tokens == 7
    assert result.trace[-1].eos and result.trace[-1].path == path


def test_eos_left_of_an_earlier_commit_cuts_the_response_there():
    truth = truth_of(12)
    truth[2] = EOS
    # slot 0 is not confident at first; slot 1 and 2 are committed, then slot 0 brings the EOS
    model = ScriptedModel(3, truth, plan={0: 0.5})
    config = ReFusionConfig(gen_length=12, slot_size=4, block_size=12, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    assert [s.committed for s in result.trace] == [[1, 2], [0]]
    assert result.trace[1].eos
    assert result.tokens == truth[:3]


def test_eos_inside_completion_drops_the_later_rows():
    truth = truth_of(8)
    truth[2] = EOS
    model = ScriptedModel(3, truth, ar={1: 0.5})
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.9, token_threshold=0.9)
    model.truth = truth + truth_of(8)
    result = run(model, config)
    (step,) = result.trace
    assert (step.path, step.chosen, step.committed, step.eos, step.rounds) == ("completion", [0, 1], [0], True, 1)
    assert result.tokens == truth[:3]
    assert step.tokens == truth[:3]  # the row is cut right after the EOS


def test_eos_inside_completion_still_decodes_the_masked_slots_left_of_it():
    """Only slots right of the EOS slot are dropped, on the completion path as on the fast path.

    The public reference drops the block's slots from the EOS row's index (0 here) instead, which
    would leave slot 0 undecoded; see the module docstring of refusion.py.
    """
    truth = truth_of(12)
    truth[6] = EOS
    # slots 0 and 2 are unsure at planning: slot 1 alone is chosen; token 5 fails, so it is completed
    model = ScriptedModel(3, truth, plan={0: 0.5, 8: 0.5}, ar={5: 0.5})
    config = ReFusionConfig(gen_length=12, slot_size=4, block_size=12, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    assert [(s.path, s.chosen, s.committed, s.eos) for s in result.trace] == [
        ("completion", [1], [1], True), ("fast", [0], [0], False)]
    assert result.tokens == truth[:7]  # slot 0, then slot 1 up to its EOS; slot 2 is never decoded
    assert fed_positions(model, len(model.calls) - 2) == [0, 1, 2, 3]  # the last plan: slot 0 alone


def test_no_slot_above_threshold_chooses_the_single_best():
    truth = truth_of(16)
    model = ScriptedModel(3, truth, plan={0: 0.3, 4: 0.4, 8: 0.7, 12: 0.6})
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=16, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    assert result.trace[0].chosen == [2] and result.trace[0].committed == [2]
    assert result.tokens == truth


def test_prompt_longer_than_a_block_keeps_true_positions():
    truth = truth_of(8)
    model = ScriptedModel(20, truth)
    config = ReFusionConfig(gen_length=8, slot_size=4, block_size=4, slot_threshold=0.9, token_threshold=0.9)
    result = run(model, config)
    assert result.tokens == truth
    assert [s.block for s in result.trace] == [0, 1]
    assert model.calls[0][1] == list(range(24))  # prompt 0..19, then the first block's masks 20..23
    assert model.calls[2][1] == [24, 25, 26, 27]  # the second block, cache holding everything before


def test_gen_length_not_a_multiple_of_the_slot_size_is_rounded_up():
    truth = truth_of(12)
    model = ScriptedModel(3, truth)
    config = ReFusionConfig(gen_length=10, slot_size=4, block_size=None, slot_threshold=0.9, token_threshold=0.9)
    assert config.padded_length == 12 and config.block_tokens == 4  # 3 slots, half of them (rounded down) per block
    result = run(model, config)
    assert result.tokens == truth
    assert [s.committed for s in result.trace] == [[0], [1], [2]]


def test_on_step_streams_every_iteration():
    truth = truth_of(16)
    model = ScriptedModel(3, truth, ar={6: 0.5})
    seen = []
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=16, slot_threshold=0.9, token_threshold=0.9)
    result = run_decoder("refusion", model, PROMPT, config, mask_token_id=MASK, eos_token_id=EOS, on_step=seen.append)
    assert seen == result.trace
    rebuilt = [None] * 16
    for step in seen:
        for offset, token in zip(step.offsets, step.tokens):
            rebuilt[offset] = token
    assert rebuilt == truth


def test_temperature_noise_is_reproducible_with_a_generator():
    truth = truth_of(8)
    config = ReFusionConfig(gen_length=8, slot_size=4, block_size=8, slot_threshold=0.0, token_threshold=0.9,
                            temperature=1.0)
    first = run_with_generator(truth, config, 7)
    second = run_with_generator(truth, config, 7)
    assert first == second
    assert any(run_with_generator(truth, config, seed) != truth for seed in range(20))


def run_with_generator(truth, config, seed):
    model = ScriptedModel(3, truth, plan={i: 0.4 for i in range(8)})
    return run_decoder("refusion", model, PROMPT, config, mask_token_id=MASK, eos_token_id=EOS,
                       generator=torch.Generator().manual_seed(seed)).tokens


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 6, "slot_size": 4}, "multiple of slot_size"),
    ({"slot_threshold": 1.5}, "slot_threshold must be in [0, 1]"),
    ({"token_threshold": -0.1}, "token_threshold must be in [0, 1]"),
    ({"gen_length": 0}, "gen_length must be a positive integer"),
    ({"slot_size": 0}, "slot_size must be a positive integer"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
])
def test_impossible_configs_are_refused_at_creation(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ReFusionConfig(**kwargs)
    assert message in str(info.value)
