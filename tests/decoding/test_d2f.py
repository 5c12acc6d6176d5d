"""D2F's decoder on a tiny bidirectional Qwen3: each rule forced with scripted probabilities, the cache
against a restatement without one, batches, sampling, presets and bad settings.

Scripted tests replace the model's logits (a forward hook): canvas position p gets a row whose best token
and its probability the test sets; the model still runs, so the K/V cache is real."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch

from refusion_cli.decoding import ConfigError, D2FConfig, run_decoder
from refusion_cli.decoding.cache import additive_mask, mask_argument
from refusion_cli.decoding.d2f import DREAM_PRESETS, LLADA_PRESETS
from refusion_cli.decoding.registry import DECODERS
from refusion_cli.errors import UserError
from tests.tiny import EOS_ID, MASK_ID, VOCAB

SCRIPT_EOS = EOS_ID  # an EOS the scripted rows can name

Row = tuple[int, float]  # (best token, its probability); the other tokens share the rest


def row_logits(best: int, probability: float, second: Row | None = None) -> list[float]:
    """Log-probabilities of one position: ``best`` at ``probability``, optionally a ``second`` token, the
    rest spread evenly (the mask token included)."""
    probs = [0.0] * VOCAB
    probs[best] = probability
    if second is not None:
        probs[second[0]] = second[1]
    rest = (1.0 - sum(probs)) / (VOCAB - (1 if second is None else 2))
    return [math.log(p if p > 0 else rest) for p in probs]


@pytest.fixture
def script(bidirectional_model):
    """``script(rows)``: the model's logits at canvas position p become ``rows(p)`` (log-probabilities);
    returns the (first position, length) each later call fed, per call (one row)."""
    handles = []

    def start(rows: Callable[[int], list[float]]) -> list[tuple[int, int]]:
        fed: list[tuple[int, int]] = []

        def hook(module, args, kwargs, out):
            positions = kwargs["position_ids"]
            fed.append((int(positions[0, 0]), int(kwargs["input_ids"].shape[1])))
            out.logits = torch.tensor([[rows(int(p)) for p in line] for line in positions], dtype=out.logits.dtype)
            return out

        handles.append(bidirectional_model.register_forward_hook(hook, with_kwargs=True))
        return fed

    yield start
    for handle in handles:
        handle.remove()


PROMPT = [5, 17, 3, 40, 22, 9]  # 6 tokens: the response starts at canvas position 6
P = len(PROMPT)


def decoder_name(shifted: bool) -> str:
    """The registry's D2F decoder reading shifted logits (Dream's) or not (LLaDA's)."""
    return "dream-d2f" if shifted else "llada-d2f"


def run(model, config: D2FConfig, *, shifted: bool = False, eos=None, prompt=PROMPT, **kwargs):
    return run_decoder(decoder_name(shifted), model, prompt, config, mask_token_id=MASK_ID, eos_token_id=eos,
                       **kwargs)


def commits(result) -> list[tuple[int, int, list[int]]]:
    """(step, block, offsets in choice order) of every record."""
    return [(record.step, record.block, record.offsets) for record in result.trace]


def truth(offset: int) -> int:
    """The token the scripted rows put at response offset ``offset``."""
    return 10 + offset


def by_offset(probabilities: dict[int, float]) -> Callable[[int], list[float]]:
    """Rows predicting truth(offset) at each response position with the given probabilities, else
    0.5 - offset / 1000 (the leftmost mask is the most confident)."""
    return lambda position: row_logits(truth(position - P),
                                       probabilities.get(position - P, 0.5 - (position - P) / 1000))


# ---------------------------------------------------------------------------------------------
# the rules, one at a time


def test_a_complete_block_with_nothing_confident_commits_its_best_one_a_step(bidirectional_model, script):
    """Nothing passes skip_threshold: block 0 (complete at once) commits its most confident mask each step;
    block 1 joins when block 0 is done (block_add_threshold 1) and is complete at once (decoded 1). Block 1's
    rows are all the same (token 20 at 0.5): equal confidences go leftmost first."""
    config = D2FConfig(gen_length=8, block_size=4, block_add_threshold=1.0, decoded_token_threshold=1.0)
    rows = by_offset({0: 0.30, 1: 0.33, 2: 0.32, 3: 0.31})
    script(lambda position: row_logits(20, 0.5) if position >= P + 4 else rows(position))
    result = run(bidirectional_model, config)
    assert commits(result) == [(0, 0, [1]), (1, 0, [2]), (2, 0, [3]), (3, 0, [0]),
                               (4, 1, [4]), (5, 1, [5]), (6, 1, [6]), (7, 1, [7])]
    assert result.tokens == [truth(offset) for offset in range(4)] + [20] * 4 and result.stats.forwards == 8


def test_confident_masks_commit_together_even_in_an_incomplete_block(bidirectional_model, script):
    """Block 1 joins once block 0 is a quarter decoded; before block 0 is done it is incomplete and commits
    only what passes skip_threshold (offsets 4, 5), then, complete, one best mask a step."""
    config = D2FConfig(gen_length=8, block_size=4, block_add_threshold=0.25, decoded_token_threshold=1.0,
                       skip_threshold=0.9)
    script(by_offset({4: 0.95, 5: 0.97, 6: 0.6, 7: 0.5}))
    result = run(bidirectional_model, config)
    assert commits(result) == [(0, 0, [0]), (1, 0, [1]), (1, 1, [4, 5]), (2, 0, [2]), (3, 0, [3]),
                               (4, 1, [6]), (5, 1, [7])]
    assert result.tokens == [truth(offset) for offset in range(8)] and result.stats.forwards == 6


@pytest.mark.parametrize("add, joins", [(0.25, 1), (0.5, 2), (1.0, 4)])
def test_a_block_joins_once_the_last_one_is_far_enough(bidirectional_model, script, add, joins):
    """Block 1's confident first mask goes the step the block is added."""
    config = D2FConfig(gen_length=8, block_size=4, block_add_threshold=add, decoded_token_threshold=1.0)
    script(by_offset({4: 0.99}))
    result = run(bidirectional_model, config)
    assert next(step for step, block, _ in commits(result) if block == 1) == joins


@pytest.mark.parametrize("decoded, complete", [(0.5, 2), (0.75, 3)])
def test_a_block_becomes_complete_once_the_one_before_is_decoded_enough(bidirectional_model, script, decoded,
                                                                         complete):
    """Nothing is confident: block 1 (added at step 1) commits nothing until block 0 reaches
    decoded_token_threshold; from then on both blocks commit one mask a step, in parallel."""
    config = D2FConfig(gen_length=8, block_size=4, block_add_threshold=0.25, decoded_token_threshold=decoded)
    script(by_offset({}))
    result = run(bidirectional_model, config)
    block_1 = [step for step, block, _ in commits(result) if block == 1]
    assert block_1[0] == complete
    assert (complete, 0, [complete]) in commits(result)  # block 0 still goes on beside it
    assert result.tokens == [truth(offset) for offset in range(8)]


def test_an_eos_stops_new_blocks_and_the_response_ends_at_it(bidirectional_model, script):
    config = D2FConfig(gen_length=12, block_size=4, block_add_threshold=0.25, decoded_token_threshold=1.0)
    rows = by_offset({1: 0.95})
    script(lambda position: row_logits(SCRIPT_EOS, 0.95) if position == P + 1 else rows(position))
    result = run(bidirectional_model, config, eos=SCRIPT_EOS)
    assert result.tokens == [truth(0), SCRIPT_EOS] and result.stats.tokens == 2
    assert {block for _, block, _ in commits(result)} == {0}  # no block joined after the EOS
    assert result.stats.forwards == 4  # block 0 finishes: the EOS at step 0, then one mask a step
    without = run(bidirectional_model, config)  # no EOS id: the same token does not stop anything
    assert {block for _, block, _ in commits(without)} == {0, 1, 2}


def test_an_eos_lets_the_blocks_already_added_finish(bidirectional_model, script):
    """The EOS comes in block 1 while block 2 is decoding: block 2 finishes, block 3 never comes."""
    config = D2FConfig(gen_length=16, block_size=4, block_add_threshold=0.5, decoded_token_threshold=0.25)
    eos_position = P + 7  # block 1's last position: committed at step 5, after block 2 joined at step 4
    rows = by_offset({})
    script(lambda position: row_logits(SCRIPT_EOS, 0.49) if position == eos_position else rows(position))
    result = run(bidirectional_model, config, eos=SCRIPT_EOS)
    blocks = {block for _, block, _ in commits(result)}
    assert blocks == {0, 1, 2}
    assert sorted(offset for _, block, offsets in commits(result) if block == 2 for offset in offsets) == [8, 9, 10, 11]
    assert result.tokens == [truth(offset) for offset in range(7)] + [SCRIPT_EOS]


def test_finished_blocks_are_cached_in_order_and_never_fed_again(bidirectional_model, script):
    """Block 1 is done first (all confident) but waits, still fed, until block 0 is done; both are then
    kept by one call, after which the calls feed only what is right of them."""
    config = D2FConfig(gen_length=12, block_size=4, block_add_threshold=0.25, decoded_token_threshold=1.0)
    fed = script(by_offset({4: 0.95, 5: 0.95, 6: 0.95, 7: 0.95, 8: 0.95}))
    result = run(bidirectional_model, config)
    # step 0: prompt + block 0; 1: block 1 joins; 2: block 2 joins (block 1 done at step 1, not finished);
    # 3: block 0 done at step 3 -> blocks 0 and 1 finished; 4: they are kept, fed from P; 5: from P + 8
    assert fed[:4] == [(0, P + 4), (P, 8), (P, 12), (P, 12)]
    assert fed[4] == (P, 12) and fed[5:] == [(P + 8, 4)] * (len(fed) - 5)
    assert result.tokens == [truth(offset) for offset in range(12)]


def test_logits_are_read_unshifted_or_shifted(bidirectional_model, script):
    """The row at canvas position p predicts token 10 + p % 40: LLaDA writes it at p, Dream at p + 1,
    also at the first position of a block fed right after the cache (read from the caching call)."""
    config = D2FConfig(gen_length=12, block_size=4, block_add_threshold=1.0, decoded_token_threshold=1.0)
    script(lambda position: row_logits(10 + position % 40, 0.5))
    llada = run(bidirectional_model, config)
    dream = run(bidirectional_model, config, shifted=True)
    assert llada.tokens == [10 + (P + offset) % 40 for offset in range(12)]
    assert dream.tokens == [10 + (P + offset - 1) % 40 for offset in range(12)]


def test_the_mask_token_is_never_a_prediction(bidirectional_model, script):
    """The mask is every position's best token; the best other one is committed, judged by its own
    probability (0.3 > skip_threshold 0.25: all four in one step)."""
    config = D2FConfig(gen_length=4, block_size=4, skip_threshold=0.25)
    script(lambda position: row_logits(MASK_ID, 0.6, second=(truth(position - P), 0.3)))
    result = run(bidirectional_model, config)
    assert result.tokens == [truth(offset) for offset in range(4)] and result.stats.forwards == 1


@pytest.mark.parametrize("rank, first", [("probability", 1), ("margin", 0), ("entropy", 1)])
def test_the_forced_commit_follows_forced_rank(bidirectional_model, script, rank, first):
    """Offset 0: 0.4 then 0.01 (margin 0.39, flat tail); offset 1: 0.5 then 0.45 (margin 0.05, low entropy)."""
    config = D2FConfig(gen_length=2, block_size=2, forced_rank=rank)
    shapes = {0: row_logits(truth(0), 0.4, second=(30, 0.01)), 1: row_logits(truth(1), 0.5, second=(31, 0.45))}
    script(lambda position: shapes.get(position - P, row_logits(0, 0.5)))
    assert commits(run(bidirectional_model, config))[0] == (0, 0, [first])


# ---------------------------------------------------------------------------------------------
# the real model


def restated(model, prompt: list[int], config: D2FConfig, shifted: bool, eos: int | None = None) -> list[int]:
    """The rules again, without a cache: every step one full pass over the prompt and the blocks added so
    far, block-causal, greedy; the response of every added block."""
    canvas, decoded, complete, finished = list(prompt), [], [], []
    eos_seen = False
    while True:
        last_progress = decoded[-1] / config.block_size if decoded else 1.0
        if len(decoded) < config.blocks and not eos_seen and last_progress >= config.block_add_threshold:
            canvas += [MASK_ID] * config.block_size
            decoded.append(0), complete.append(False), finished.append(False)
        progress = [1.0] + [count / config.block_size for count in decoded]
        for index in range(len(decoded)):
            complete[index] = complete[index] or progress[index] >= config.decoded_token_threshold
        if all(finished):
            return canvas[len(prompt):]
        block_of = [-1] * len(prompt) + [index for index in range(len(decoded)) for _ in range(config.block_size)]
        sees = torch.tensor([[k <= q for k in block_of] for q in block_of])
        mask = additive_mask(sees, torch.float64)
        logits = model(input_ids=torch.tensor([canvas]), attention_mask=mask_argument(model.config, mask)).logits[0]
        if shifted:
            logits = torch.cat([logits[:1], logits[:-1]])
        probs = logits.softmax(-1)
        probs_other = probs.clone()
        probs_other[:, MASK_ID] = 0
        for index in range(len(decoded)):
            if finished[index]:
                continue
            start = len(prompt) + index * config.block_size
            masked = [p for p in range(start, start + config.block_size) if canvas[p] == MASK_ID]
            tokens = {p: int(probs_other[p].argmax()) for p in masked}
            sure = [p for p in masked if float(probs[p, tokens[p]]) > config.skip_threshold]
            if complete[index] and masked and not sure:
                sure = [max(masked, key=lambda p: (float(probs[p, tokens[p]]), -p))]
            for p in sure:
                canvas[p] = tokens[p]
            decoded[index] += len(sure)
            eos_seen = eos_seen or eos in [tokens[p] for p in sure]
        for index in range(len(decoded)):
            start = len(prompt) + index * config.block_size
            if MASK_ID not in canvas[start: start + config.block_size] and all(finished[:index]):
                finished[index] = True


PARALLEL = D2FConfig(gen_length=24, block_size=4, block_add_threshold=0.25, decoded_token_threshold=0.5,
                     skip_threshold=0.3)


@pytest.mark.parametrize("shifted", [False, True], ids=["llada", "dream"])
def test_the_cache_gives_the_tokens_of_full_passes(bidirectional_model, shifted):
    """A finished block's K/V sees only itself and earlier, final, blocks: caching it is exact."""
    result = run(bidirectional_model, PARALLEL, shifted=shifted)
    assert any(len(record.offsets) > 1 for record in result.trace)  # several tokens in one step
    assert any(len({r.block for r in result.trace if r.step == record.step}) > 1 for record in result.trace)
    assert result.tokens == restated(bidirectional_model, PROMPT, PARALLEL, shifted)[: len(result.tokens)]
    assert result.stats.forwards < PARALLEL.gen_length


@pytest.mark.parametrize("shifted", [False, True], ids=["llada", "dream"])
def test_a_batch_decodes_each_row_as_alone(bidirectional_model, shifted):
    prompts = [PROMPT, [7, 8, 9], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    alone = [run(bidirectional_model, PARALLEL, shifted=shifted, prompt=prompt) for prompt in prompts]
    for batch_size in (None, 2):
        together = run_decoder(decoder_name(shifted), bidirectional_model, prompts, PARALLEL, mask_token_id=MASK_ID,
                               eos_token_id=None, batch_size=batch_size)
        assert [result.tokens for result in together] == [result.tokens for result in alone]
        assert [result.trace for result in together] == [result.trace for result in alone]
        assert [result.stats.forwards for result in together] == [result.stats.forwards for result in alone]


def test_sampling_follows_the_explicit_generator(bidirectional_model):
    config = dataclasses.replace(PARALLEL, temperature=1.0, top_k=8)
    draws = [run(bidirectional_model, config, generator=torch.Generator().manual_seed(seed)) for seed in (7, 7, 8)]
    assert draws[0].tokens == draws[1].tokens and draws[0].trace == draws[1].trace
    assert draws[0].tokens != draws[2].tokens
    assert draws[0].tokens != run(bidirectional_model, PARALLEL).tokens


def test_the_remainder_of_gen_length_is_never_decoded(bidirectional_model):
    config = D2FConfig(gen_length=10, block_size=4, skip_threshold=0.0)  # two blocks; two positions left over
    result = run(bidirectional_model, config)
    assert len(result.tokens) == config.response_length == 8 and MASK_ID not in result.tokens


# ---------------------------------------------------------------------------------------------
# settings


def test_defaults_and_the_evaluation_scripts_presets():
    config = D2FConfig()
    assert (config.gen_length, config.block_size, config.block_add_threshold, config.decoded_token_threshold,
            config.skip_threshold, config.temperature, config.forced_rank) == (512, 32, 0.1, 0.95, 0.9, 0.0,
                                                                               "probability")
    rows = lambda presets: {name: (c.gen_length, c.block_size, c.block_add_threshold, c.decoded_token_threshold,
                                   c.skip_threshold) for name, c in presets.items()}
    assert rows(LLADA_PRESETS) == {"gsm8k": (512, 64, 0.7, 0.95, 0.9), "mbpp": (512, 32, 0.9, 0.95, 0.9),
                                   "math": (512, 32, 0.1, 0.95, 0.9), "humaneval": (512, 32, 0.1, 0.95, 0.9)}
    assert rows(DREAM_PRESETS) == {"gsm8k": (256, 32, 0.1, 0.95, 0.9), "mbpp": (256, 48, 0.1, 0.95, 0.9),
                                   "math": (256, 64, 0.1, 0.95, 0.9), "humaneval": (256, 32, 0.9, 0.95, 0.95)}
    assert dict(DECODERS["llada-d2f"].presets) == LLADA_PRESETS and dict(DECODERS["dream-d2f"].presets) == DREAM_PRESETS
    assert (DECODERS["llada-d2f"].shifted, DECODERS["dream-d2f"].shifted) == (False, True)


@pytest.mark.parametrize(("options", "message"), [
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"gen_length": 16, "block_size": 32}, "block_size (32) must not exceed gen_length (16)"),
    ({"block_add_threshold": 1.5}, "block_add_threshold must be in [0, 1]"),
    ({"decoded_token_threshold": -0.1}, "decoded_token_threshold must be in [0, 1]"),
    ({"skip_threshold": 2.0}, "skip_threshold must be in [0, 1]"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be > 0"),
    ({"top_k": 0}, "top_k must be a positive integer"),
    ({"forced_rank": "random"}, "forced_rank must be one of probability, margin, entropy"),
])
def test_impossible_settings_fail_at_config_time(options, message):
    with pytest.raises(ConfigError) as caught:
        D2FConfig(**options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_mask_id_outside_the_vocabulary_is_refused(bidirectional_model):
    with pytest.raises(UserError, match=f"mask_token_id {VOCAB + 5} is outside the model's vocabulary"):
        run_decoder("llada-d2f", bidirectional_model, PROMPT, PARALLEL, mask_token_id=VOCAB + 5, eos_token_id=None)
