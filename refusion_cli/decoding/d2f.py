"""D2F's decoder (Discrete Diffusion Forcing): a pipeline of blocks of masks, several decoded at once,
the K/V of each finished block cached, on LLaDA (logits read unshifted) or Dream (shifted).

Token ids in, token ids out. The response grows by blocks of ``block_size`` masks, at most
``gen_length // block_size`` of them (a remainder of ``gen_length`` is never decoded). Attention is
block-causal: the prompt is one block, and a response block sees the prompt, every earlier block
and all of itself, never a later block. A block is *decoding*, then *finished* (no mask left, and
no earlier block still decoding), then *cached* (its K/V kept from the next call on). Each step is
one model call:

1) add       a new block of masks joins at the end when the last block (the prompt counts as
             decoded) is at least ``block_add_threshold`` decoded, while the budget has room and no
             committed token was an EOS;
2) complete  a block becomes *complete* once the block before it is at least
             ``decoded_token_threshold`` decoded (the first response block at once); it stays so;
3) feed      the call feeds every position right of the cached ones: the blocks finished at the
             last step (their K/V is kept from this call) and the blocks still decoding;
4) commit    each decoding block predicts its masks as Dream's sampler does (argmax at temperature
             0; the mask token keeps its share of the probabilities but is never a prediction) and
             commits every one whose token has probability > ``skip_threshold``; a complete block with
             none over it commits its best one by ``forced_rank`` (the leftmost of equals);
5) finish    a decoding block with no mask left is finished when no block before it is decoding.

Decoding ends when no block is decoding and none can be added. ``shifted`` (Dream): the token at
position p is read from the logits of p - 1; for the first fed position those come from the call
that cached the position before it. The model computes the logits that predict a mask and no others
(shifted: also those of the last position a call caches). :func:`d2f_row` is one prompt's program;
``engine.run_decoder`` ("llada-d2f", "dream-d2f") decodes a list of prompts as a batch, each row as
alone (see mdm); ``result.trace`` holds one record per block and step that committed. Without draws
(temperature 0, the scripts' setting) step 4) is one function for every decoding block of every row of a step
(:func:`pipeline_choice`, yielded with ``readback.decide``); with draws each block draws from its row's own
generator, in turn.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import numpy as np
import torch

from refusion_cli.decoding.batching import firsts_of
from refusion_cli.decoding.config import ConfigError, check_non_negative, check_positive, check_probability
from refusion_cli.decoding.dream import DreamConfig, check_filters, predict_tokens
from refusion_cli.decoding.canvas import Block, Canvas, CanvasStep, Written
from refusion_cli.decoding.mdm import CanvasFeed, plain_logits, read_offsets, take_rows
from refusion_cli.decoding.mdm_sampling import choose_positions
from refusion_cli.decoding.readback import decide, device_index, read
from refusion_cli.decoding.stats import DecodeResult, eos_ids, wide_float

# forced_rank -> the Dream ranking that computes it (D2F's sampling_strategy default / margin_confidence / neg_entropy)
FORCED_RANKS = {"probability": "maskgit_plus", "margin": "topk_margin", "entropy": "entropy"}


@dataclass(frozen=True)
class D2FConfig:
    """D2F's decoder settings. The defaults are the evaluation scripts' commonest LLaDA row (MATH and
    HumanEval); its evaluation class's own defaults (4-token blocks, skip_threshold 1.0, sampling at
    0.2) are placeholders every script overrides."""

    gen_length: int = 512  # response budget: gen_length // block_size blocks at most
    block_size: int = 32  # tokens per block
    block_add_threshold: float = 0.1  # a block is added once the last one is this share decoded
    decoded_token_threshold: float = 0.95  # a block this share decoded makes the next one complete
    skip_threshold: float = 0.9  # a decoding block commits every mask whose token has probability > this
    temperature: float = 0.0  # 0: argmax; > 0: tokens drawn from softmax(logits / temperature)
    top_p: float | None = None  # nucleus filtering before sampling (None or 1 = off)
    top_k: int | None = None  # top-k filtering before sampling (None = off)
    forced_rank: str = "probability"  # a complete block's forced commit: best "probability", "margin" or "entropy"

    def __post_init__(self) -> None:
        check_positive("gen_length", self.gen_length)
        check_positive("block_size", self.block_size)
        if self.block_size > self.gen_length:
            raise ConfigError(f"block_size ({self.block_size}) must not exceed gen_length ({self.gen_length})")
        for name in ("block_add_threshold", "decoded_token_threshold", "skip_threshold"):
            check_probability(name, getattr(self, name))
        check_non_negative("temperature", self.temperature)
        check_filters(self.top_p, self.top_k)
        if self.forced_rank not in FORCED_RANKS:
            raise ConfigError(f"forced_rank must be one of {', '.join(FORCED_RANKS)}, got {self.forced_rank!r}")

    @property
    def blocks(self) -> int:
        """The most blocks a response holds."""
        return self.gen_length // self.block_size

    @property
    def response_length(self) -> int:
        """The positions the blocks can fill: gen_length less its remainder."""
        return self.blocks * self.block_size

    @property
    def token_sampling(self) -> DreamConfig:
        """The settings of Dream's token prediction that D2F's equals (its ``sample_tokens`` is Dream's)."""
        return DreamConfig(gen_length=1, steps=1, alg=FORCED_RANKS[self.forced_rank], temperature=self.temperature,
                           top_p=self.top_p, top_k=self.top_k)


# The settings of D2F's evaluation scripts per benchmark (temperature 0, sampling_strategy default), under the
# toolkit's benchmark keys. LLaDA-8B-Instruct + its adapter, 512-token responses (eval_llada.sh):
LLADA_PRESETS: dict[str, D2FConfig] = {
    "gsm8k": D2FConfig(gen_length=512, block_size=64, block_add_threshold=0.7, decoded_token_threshold=0.95,
                       skip_threshold=0.9),
    "mbpp": D2FConfig(gen_length=512, block_size=32, block_add_threshold=0.9, decoded_token_threshold=0.95,
                      skip_threshold=0.9),
    "math": D2FConfig(gen_length=512, block_size=32, block_add_threshold=0.1, decoded_token_threshold=0.95,
                      skip_threshold=0.9),  # minerva_math
    "humaneval": D2FConfig(gen_length=512, block_size=32, block_add_threshold=0.1, decoded_token_threshold=0.95,
                           skip_threshold=0.9),
}
# Dream: the only published settings are those of Dream-v0-Base-7B + its adapter, 256-token responses
# (eval_dream.sh; gsm8k is its gsm8k_cot; mbpp's 48-token blocks fill 240 of the 256 positions)
DREAM_PRESETS: dict[str, D2FConfig] = {
    "gsm8k": D2FConfig(gen_length=256, block_size=32, block_add_threshold=0.1, decoded_token_threshold=0.95,
                       skip_threshold=0.9),
    "mbpp": D2FConfig(gen_length=256, block_size=48, block_add_threshold=0.1, decoded_token_threshold=0.95,
                      skip_threshold=0.9),
    "math": D2FConfig(gen_length=256, block_size=64, block_add_threshold=0.1, decoded_token_threshold=0.95,
                      skip_threshold=0.9),  # minerva_math
    "humaneval": D2FConfig(gen_length=256, block_size=32, block_add_threshold=0.9, decoded_token_threshold=0.95,
                           skip_threshold=0.95),
}


class BlockState(enum.Enum):
    DECODING = "decoding"  # has masks, or an earlier block is still decoding
    FINISHED = "finished"  # its K/V is kept by the next call
    CACHED = "cached"  # its K/V is in the row's cache


@dataclass
class PipelineBlock:
    span: Block  # its canvas positions; span.index counts response blocks from 0 (-1: the prompt)
    decoded: int = 0  # positions committed so far
    complete: bool = False  # commits at least one token a step
    state: BlockState = BlockState.DECODING

    @property
    def progress(self) -> float:
        return self.decoded / self.span.length


def d2f_row(canvas: Canvas, config: D2FConfig, shifted: bool,
            generator: torch.Generator | None) -> CanvasStep[DecodeResult]:
    """One prompt's D2F decode as a row program (see mdm.canvas_row): one model call and one readback a step."""
    sampling = config.token_sampling
    stops = set(eos_ids(canvas.eos_token_id))
    prompt = PipelineBlock(Block(-1, 0, canvas.prompt_length), decoded=canvas.prompt_length, complete=True,
                           state=BlockState.FINISHED)
    blocks = [prompt]
    cached = 0  # positions whose K/V the row's store keeps
    before_first: torch.Tensor | None = None  # shifted: logits [V] of the last cached position
    eos_committed = False
    step = 0
    while True:
        # 1) add
        if len(blocks) - 1 < config.blocks and not eos_committed and blocks[-1].progress >= config.block_add_threshold:
            start = blocks[-1].span.end
            blocks.append(PipelineBlock(Block(len(blocks) - 1, start, start + config.block_size)))
        # 2) complete
        for earlier, later in zip(blocks, blocks[1:]):
            if earlier.progress >= config.decoded_token_threshold:
                later.complete = True
        decoding = [block for block in blocks if block.state is BlockState.DECODING]
        if not decoding:
            break
        # 3) feed
        finished = [block for block in blocks if block.state is BlockState.FINISHED]
        keep = finished[-1].span.end - cached if finished else None
        end = blocks[-1].span.end
        masks = [[block.span.start + offset for offset in canvas.masked_offsets(block.span)] for block in decoding]
        predictors = [position - int(shifted) for where in masks for position in where]  # [M]: each mask's logits
        wanted = [max(predictor, cached) for predictor in predictors]  # (+ 1: the last kept position, shifted)
        if shifted and keep is not None:
            wanted.append(cached + keep - 1)
        offsets, rows = read_offsets(wanted, cached)
        logits, _ = yield CanvasFeed(canvas.stats, canvas.ids[cached:end], start=cached, prefix=cached, keep=keep,
                                     among=block_causal(canvas, config.block_size, cached, end), read=offsets)
        read_logits = take_rows(plain_logits(logits), rows)  # [M (+ 1), V]
        # shifted: a mask at the first fed position is predicted by the last cached one, from an earlier call
        mask_logits = read_logits[: len(predictors)]
        if predictors and predictors[0] < cached:  # ascending: only the first can be
            assert before_first is not None, "a position before the call was fed in an earlier call"
            mask_logits = torch.cat([before_first[None], mask_logits[1:]])
        if keep is not None:
            for block in finished:
                block.state = BlockState.CACHED
            if shifted:
                before_first = read_logits[-1]
        cached += keep or 0
        # 4) commit: every decoding block's choice on the device, then one readback for all of them
        sizes = [len(where) for where in masks]
        if config.temperature > 0:  # the draws are the row's own, block by block
            writes = [choose(canvas, block, rows_of_block, config, sampling, generator)
                      for block, rows_of_block in zip(decoding, mask_logits.split(sizes))]
            commits = yield from record_all(canvas, writes, step)
        else:  # every waiting row's blocks at once
            commits = yield from commit_all(canvas, decoding, masks, mask_logits, config, step)
        for block, committed in zip(decoding, commits):
            block.decoded += len(committed)
            eos_committed = eos_committed or bool(stops & set(committed))
        # 5) finish
        for block in decoding:
            before = blocks[: blocks.index(block)]
            if not canvas.mask_count(block.span) and all(e.state is not BlockState.DECODING for e in before):
                block.state = BlockState.FINISHED
        step += 1
    return canvas.result()


def choose(canvas: Canvas, block: PipelineBlock, rows: torch.Tensor, config: D2FConfig, sampling: DreamConfig,
           generator: torch.Generator | None) -> Written | None:
    """4) Write ``block``'s masks whose token has probability > skip_threshold, or, for a complete block with
    none, its best one, on the device (None: the block has no mask); ``rows`` [n, V] are the logits that predict
    the block's n masks, left to right."""
    n_masked = rows.shape[0]
    if n_masked == 0:
        return None
    masked = device_index(canvas.masked_offsets(block.span), canvas.device)  # block offsets of its masks [n]
    tokens, token_prob, confidence = predict_tokens(rows, sampling, canvas.mask_token_id, generator)
    chosen = token_prob > config.skip_threshold  # [n]
    if block.complete:
        best, _ = choose_positions(confidence, token_prob, torch.ones_like(chosen), n_masked=n_masked, count=1,
                                   threshold=None)
        chosen = torch.where(chosen.any(), chosen, torch.zeros_like(chosen).index_fill_(0, best, True))
    return canvas.write(block.span, masked, tokens, chosen)


def pipeline_choice(sizes: list[int], logits: torch.Tensor, block_first: torch.Tensor, complete: torch.Tensor, *,
                    sampling: DreamConfig, mask_token_id: int, skip_threshold: float) -> tuple[torch.Tensor, ...]:
    """4) without draws, for every row waiting on it at once: ``logits`` [sum M, V] that predict each row's M masks
    (its decoding blocks' in turn; the rows end to end, ``sizes``), with the place in its row of each mask's block's
    first mask and whether that block is complete [sum M]. Returns each mask's token and whether it is committed:
    its probability exceeds ``skip_threshold``, or its block is complete with none that does and it is the block's
    best by ``sampling``'s ranking (the leftmost of equals), each [sum M]."""
    tokens, token_prob, confidence = predict_tokens(logits, sampling, mask_token_id, None)
    chosen = token_prob > skip_threshold  # [sum M]
    # [sum M]: each mask's block, named by the index of its first mask (its row's start + its place in the row)
    block = device_index(firsts_of(sizes), logits.device) + block_first
    index = torch.arange(len(block), device=logits.device)
    ranked = confidence.to(wide_float(logits.device))
    best = ranked.new_full(ranked.shape, float("-inf")).scatter_reduce(0, block, ranked, "amax")  # by block
    leftmost = index.new_full(index.shape, len(index)).scatter_reduce(
        0, block, torch.where(ranked == best[block], index, len(index)), "amin")
    any_chosen = torch.zeros_like(index).scatter_reduce(0, block, chosen.long(), "amax")
    return tokens, chosen | (complete & (any_chosen[block] == 0) & (index == leftmost[block]))


def commit_all(canvas: Canvas, decoding: list[PipelineBlock], masks: list[list[int]], logits: torch.Tensor,
               config: D2FConfig, step: int) -> CanvasStep[list[list[int]]]:
    """4) without draws: the tokens each decoding block commits (its ``masks``' canvas positions, predicted by
    ``logits`` [M, V]), chosen for every row waiting on it at once (:func:`pipeline_choice`), written and recorded
    (one trace record per block that committed any)."""
    sizes = [len(where) for where in masks]
    if not sum(sizes):
        return [[] for _ in decoding]
    decision = functools.partial(pipeline_choice, sampling=config.token_sampling, mask_token_id=canvas.mask_token_id,
                                 skip_threshold=config.skip_threshold)
    firsts = firsts_of(sizes)
    complete = np.repeat([block.complete for block in decoding], sizes)
    tokens, chosen = yield from decide((pipeline_choice, *decision.keywords.items()), decision, logits, firsts,
                                       complete, ragged=True)
    commits, at = [], 0
    for block, where in zip(decoding, masks):
        kept = [j for j in range(at, at + len(where)) if chosen[j]]
        commits.append((block.span, [where[j - at] - block.span.start for j in kept], [tokens[j] for j in kept]))
        at += len(where)
    recorded = iter(canvas.commit_blocks(step, [commit for commit in commits if commit[1]]))
    return [next(recorded) if offsets else [] for _, offsets, _ in commits]


def record_all(canvas: Canvas, writes: list[Written | None], step: int) -> CanvasStep[list[list[int]]]:
    """The tokens each write committed (none for None), read back at once; a write that committed any is
    recorded (one trace record per block)."""
    tensors = [tensor for written in writes if written is not None for tensor in written.tensors()]
    values = (yield from read(*tensors)) if tensors else ()
    committed, at = [], 0
    for written in writes:
        tokens: list[int] = []
        if written is not None:
            part, at = values[at: at + 3], at + 3
            if any(part[2]):
                tokens = canvas.record(written, step, part)
        committed.append(tokens)
    return committed


def block_causal(canvas: Canvas, block_size: int, start: int, end: int) -> np.ndarray:
    """[Q, Q] bool (host) over canvas positions start..end-1: q sees k when k's block is q's or an earlier one
    (the prompt is the first block)."""
    block_of = np.maximum((np.arange(start, end) - canvas.prompt_length) // block_size, -1)
    return block_of[None, :] <= block_of[:, None]


__all__ = ["D2FConfig", "DREAM_PRESETS", "FORCED_RANKS", "LLADA_PRESETS"]
