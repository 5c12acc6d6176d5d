"""Dream's logits a chunk at a time: no row holds more than LOGITS_CHUNK × V logits, and the tokens are those of
one [masks, V] pass.

Plain Dream reads the logits before every mask of its one block; with more reads than ``mdm.LOGITS_CHUNK`` the
call computes no logits and the row applies the model's head to the read positions' hidden states a chunk at a
time (mdm.HeadInput, mdm.logit_chunks). The reference is the same decode with the chunk made larger than any
canvas (the model computes every read's logits in the call, the sampler takes them all at once). On the CPU
``torch.multinomial``'s draws do not depend on the rows beside them, nor do the head's rows in float64 and
bfloat16 when chunks start at multiples of 4 and hold at least 4 rows (mdm.SMALLEST_CHUNK): the tokens,
sampled ones included, are equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refusion_cli.decoding import DreamConfig, mdm, run_decoder
from refusion_cli.decoding.mdm import CanvasRunner, CanvasFeed, HeadInput, output_head
from refusion_cli.decoding.stats import DecodeStats
from tests.decoding.scripted import FixedRowsModel, log_probs
from tests.tiny import MASK_ID, tiny_qwen3

CHUNK = 8  # the chunk under test: a 40-token response reads 5 chunks on its first step
UNCHUNKED = 10**9  # the reference: every read's logits at once
GEN_LENGTH = 40
TABLE1 = DreamConfig(gen_length=GEN_LENGTH, steps=GEN_LENGTH)  # row 6: entropy, temperature 0.2, top-p 0.95
CONFIGS = {
    "table1": TABLE1,
    "greedy": dataclasses.replace(TABLE1, temperature=0.0, top_p=None),
    "topk-margin-top-k": dataclasses.replace(TABLE1, alg="topk_margin", top_p=None, top_k=5, steps=10),
    "maskgit-alg-temp": dataclasses.replace(TABLE1, alg="maskgit_plus", alg_temp=0.5, steps=20),
    "origin": dataclasses.replace(TABLE1, alg="origin", temperature=1.0, top_p=0.9, steps=10),
    "threshold": dataclasses.replace(TABLE1, alg="maskgit_plus", temperature=0.0, top_p=None, threshold=0.3),
    "dual-cache": dataclasses.replace(TABLE1, alg="maskgit_plus", temperature=0.0, top_p=None, block_length=20,
                                      steps=4, use_cache=True, dual_cache=True),
}


@pytest.fixture
def head_rows():
    """``head_rows(model)`` -> a list that receives, per call of the model's head, the logits rows it made per row."""
    handles = []

    def start(model: torch.nn.Module) -> list[int]:
        rows: list[int] = []
        handles.append(output_head(model).register_forward_hook(
            lambda module, args, out: rows.append(out.shape[-2])))  # [B, U, V] in the call, [n, V] in a row
        return rows

    yield start
    for handle in handles:
        handle.remove()


def decode(model, prompts, config, chunk, monkeypatch, seed=0, mask_token_id=MASK_ID, **options):
    """The results of ``prompts`` (a batch) with the chunk set to ``chunk``; row i draws from seed + i."""
    monkeypatch.setattr(mdm, "LOGITS_CHUNK", chunk)
    generators = [torch.Generator().manual_seed(seed + row) for row in range(len(prompts))]
    return run_decoder("dream", model, prompts, config, mask_token_id=mask_token_id, eos_token_id=None,
                       generator=generators, **options)


def assert_same(chunked, whole) -> None:
    for got, expected in zip(chunked, whole, strict=True):
        assert got.tokens == expected.tokens
        assert got.trace == expected.trace  # the same masks unmasked at each step
        assert got.stats.forwards == expected.stats.forwards


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_logits_give_the_tokens_of_one_pass(bidirectional_model, prompt, head_rows, monkeypatch, name):
    config = CONFIGS[name]
    whole = decode(bidirectional_model, [prompt], config, UNCHUNKED, monkeypatch, seed=3)
    rows = head_rows(bidirectional_model)
    chunked = decode(bidirectional_model, [prompt], config, CHUNK, monkeypatch, seed=3)
    assert_same(chunked, whole)
    assert max(rows) <= CHUNK
    if config.block_tokens > CHUNK and not (config.use_cache and config.steps_per_block > 1):
        assert 0 in rows  # a call that read more than a chunk computed no logits


def test_a_dream_decode_holds_at_most_a_chunk_of_logits_in_bfloat16(head_rows, monkeypatch):
    """Table 1's row 6 settings on a bfloat16 model with a larger vocabulary, as a checkpoint runs."""
    model = tiny_qwen3(5, causal=False, dtype=torch.bfloat16, vocab=2048, init_std=0.4)
    prompt, mask = [5, 17, 3, 40, 22, 9], 2047
    whole = decode(model, [prompt], TABLE1, UNCHUNKED, monkeypatch, mask_token_id=mask)
    rows = head_rows(model)
    assert_same(decode(model, [prompt], TABLE1, CHUNK, monkeypatch, mask_token_id=mask), whole)
    masks_before_each_step = [GEN_LENGTH - sum(len(step.offsets) for step in whole[0].trace[:index])
                              for index in range(len(whole[0].trace))]
    assert max(rows) <= CHUNK and sum(rows) == sum(masks_before_each_step)  # each read's logits once


@pytest.mark.parametrize("name", ["table1", "dual-cache"])
def test_batched_rows_take_their_chunks_alone(bidirectional_model, head_rows, monkeypatch, name):
    prompts = [[5, 17, 3], [40, 22, 9, 11, 30, 2, 8], [7, 1, 12, 19, 4]]
    whole = decode(bidirectional_model, prompts, CONFIGS[name], UNCHUNKED, monkeypatch, batch_size=3)
    rows = head_rows(bidirectional_model)
    chunked = decode(bidirectional_model, prompts, CONFIGS[name], CHUNK, monkeypatch, batch_size=3)
    assert_same(chunked, whole)
    assert max(rows) <= CHUNK


def test_a_peft_wrapped_model_hands_on_its_head(monkeypatch, prompt, head_rows):
    """A PeftModel (LoRA on the head too) takes no logits_to_keep: the head's whole input is cut to the reads. (A
    call that reads a chunk or less computes every column's logits there, as before: the toolkit puts adapters into
    the model itself, which keeps its logits_to_keep.)"""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen3(6, causal=False, init_std=0.4),
                           LoraConfig(r=2, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    model.eval()
    whole = decode(model, [prompt], TABLE1, UNCHUNKED, monkeypatch)
    rows = head_rows(model)
    assert_same(decode(model, [prompt], TABLE1, CHUNK, monkeypatch), whole)
    assert 0 in rows and max(rows[:GEN_LENGTH // CHUNK + 1]) <= CHUNK  # the first call: none, then its chunks


def test_a_model_without_a_reachable_head_is_read_a_chunk_at_a_time(monkeypatch):
    """A scripted stand-in computes every logit in its call; the sampler still takes them a chunk at a time."""
    model = FixedRowsModel({}, default=log_probs([0.2, 0.45, 0.35 - 1e-9, 1e-9]))
    config = dataclasses.replace(TABLE1, gen_length=8, steps=8, top_p=None)
    whole = decode(model, [[0, 1]], config, UNCHUNKED, monkeypatch, mask_token_id=3)
    assert_same(decode(model, [[0, 1]], config, 3, monkeypatch, mask_token_id=3), whole)


def test_a_call_with_a_chunked_row_gives_another_row_its_logits(bidirectional_model, monkeypatch):
    """A call over more than a chunk of reads computes no logits; a row whose feed is not chunked gets its reads'
    logits from the head all the same, those of a call alone."""
    monkeypatch.setattr(mdm, "LOGITS_CHUNK", 8)
    ids = torch.tensor([5, 17, 3] + [MASK_ID] * 12)
    reads = torch.arange(2, 14)
    calls = CanvasRunner(bidirectional_model)
    replies = calls.forward({0: CanvasFeed(DecodeStats(), ids, read=reads, chunked=True),
                             1: CanvasFeed(DecodeStats(), ids, read=reads)})
    alone = bidirectional_model(input_ids=ids[None], logits_to_keep=reads).logits[0]
    assert isinstance(replies[0][0], HeadInput) and len(replies[0][0]) == reads.numel()
    assert torch.equal(torch.cat(list(mdm.logit_chunks(replies[0][0]))), alone)
    assert torch.equal(replies[1][0], alone)


def test_a_last_chunk_of_under_4_rows_takes_4_from_the_one_before(monkeypatch):
    """The CPU's BLAS computes a product of 1-3 rows another way: such a last chunk would round differently."""
    monkeypatch.setattr(mdm, "LOGITS_CHUNK", CHUNK)
    sizes = lambda rows: [len(chunk) for chunk in mdm.logit_chunks(torch.zeros(rows, 2))]  # noqa: E731
    assert sizes(0) == [0] and sizes(3) == [3] and sizes(16) == [8, 8] and sizes(20) == [8, 8, 4]
    assert sizes(17) == [8, 4, 5] and sizes(19) == [8, 4, 7]
