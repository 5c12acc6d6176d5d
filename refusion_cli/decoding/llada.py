"""LLaDA's sampler: semi-autoregressive blocks of masks, a fixed number of unmaskings per step.

Token ids in, token ids out. The response starts all masked and is decoded in blocks of
``block_length`` tokens, left to right; ``steps`` are split evenly over the blocks. Each step:

1) predict   one pass (two with classifier-free guidance; a cached step feeds only part of the
             canvas, below) predicts every position of the block, logits read *unshifted*
             (position i's logits give position i's token; the model computes the block's
             logits only); argmax, or argmax with Gumbel noise at ``temperature`` > 0
             (float64). The mask token is never a prediction (the reference would leave such a
             position masked).
2) rank      confidence = softmax probability (float64, over the whole vocabulary, mask
             included) of the prediction (``low_confidence``) or a uniform draw (``random``);
             positions right of the block are never candidates.
3) unmask    the top-n masked positions, n from the even schedule (masks // steps, the remainder
             spread over the first steps); with ``threshold`` (Fast-dLLM) the best position plus
             every other whose prediction has probability >= threshold, until the block is done
             (``steps`` then plays no part).

``use_cache`` keeps the prompt + finished blocks' K/V from each block's first pass (Fast-dLLM's
prefix cache) and ``dual_cache`` the K/V right of the block too, so that later steps feed the block
alone (Fast-dLLM's dual cache); both are exact for causal models and approximate for bidirectional
ones. With either, a block's first step is the full pass and counts as a step of its schedule, and
a cached step always follows it (see canvas.Canvas.steps). :func:`llada_row` is one prompt's program;
``engine.run_decoder`` decodes a list of prompts as a batch, each row as alone (see mdm). The model
should be bidirectional (see ``registry.check_decoder_fits``); it is not checked here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from refusion_cli.decoding.batching import token_probs, uniform, with_gumbel
from refusion_cli.decoding.config import ConfigError, check_non_negative
from refusion_cli.decoding.canvas import Block, Canvas, CanvasStep, even_schedule
from refusion_cli.decoding.mdm import CanvasPasses, plain_logits
from refusion_cli.decoding.mdm_sampling import (best_first, check_blocks, check_fast_options, forbid_mask,
                                                 kept_places, masked_confidence)
from refusion_cli.decoding.readback import decide
from refusion_cli.decoding.stats import DecodeResult, wide_float

REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class LLaDAConfig:
    """LLaDA's sampler settings; defaults are those of LLaDA's reference ``generate.py`` demo."""

    gen_length: int = 128  # response length in tokens (the whole budget is decoded, then cut after EOS)
    steps: int = 128  # denoising steps over the whole response, split evenly over the blocks
    block_length: int = 32  # semi-autoregressive block size; must divide gen_length
    remasking: str = "low_confidence"  # how masked positions are ranked: "low_confidence" or "random"
    temperature: float = 0.0  # Gumbel noise on the predictions (0 = argmax)
    cfg_scale: float = 0.0  # classifier-free guidance: logits = un + (cfg_scale + 1)(cond - un); 0 = off
    threshold: float | None = None  # Fast-dLLM parallel unmasking: keep every token with p >= threshold
    use_cache: bool = False  # Fast-dLLM prefix KV cache (approximate for bidirectional models)
    dual_cache: bool = False  # with use_cache: also cache the K/V right of the block (Fast-dLLM's dual cache)

    def __post_init__(self) -> None:
        check_blocks(self.gen_length, self.steps, self.block_length)
        if self.remasking not in REMASKING:
            raise ConfigError(f"remasking must be one of {', '.join(REMASKING)}, got {self.remasking!r}")
        check_non_negative("cfg_scale", self.cfg_scale)
        check_fast_options(self.threshold, self.use_cache, self.dual_cache, self.temperature)

    @property
    def steps_per_block(self) -> int:
        return self.steps // (self.gen_length // self.block_length)


# Fast-dLLM as Table 1's LLaDA row runs it (Fast-dLLM's evaluation scripts): greedy, blocks of 32, threshold 0.9,
# prefix and dual cache; Table 1's 512-token budget, and steps one a token, as registry.length_settings makes them
# for any budget (a threshold leaves them unused)
FAST_DLLM_PRESETS: Mapping[str, LLaDAConfig] = MappingProxyType({
    "fast-dllm": LLaDAConfig(gen_length=512, steps=512, block_length=32, threshold=0.9, use_cache=True,
                             dual_cache=True)})


def guided_logits(cond: CanvasPasses, uncond: CanvasPasses | None, canvas: Canvas, block: Block,
                  cfg_scale: float) -> CanvasStep[torch.Tensor]:
    """1) The block's logits [B, V] in the model's dtype. With guidance, a second pass with the prompt replaced by
    masks; the two are combined in the model's own dtype, as the reference combines the logits the model
    returns. The model computes the logits of the block's positions only."""
    positions = range(block.start, block.end)  # [B]
    logits = plain_logits((yield from cond(canvas.ids, positions)))
    if uncond is not None:
        unprompted = canvas.ids.clone()
        unprompted[: canvas.prompt_length] = canvas.mask_token_id
        unconditional = plain_logits((yield from uncond(unprompted, positions)))
        logits = unconditional + (cfg_scale + 1) * (logits - unconditional)
    return logits


def choose(logits: torch.Tensor, block_ids: torch.Tensor, *noise: torch.Tensor, mask_token_id: int,
           threshold: float | None, temperature: float, remasking: str) -> tuple[torch.Tensor, ...]:
    """Steps 1-3 for N rows at once, on the device: ``logits`` [N, B, V] (the model's dtype; argmax and softmax in
    float64, float32 on MPS, as the reference), the block's ids [N, B], and the rows' draws (``temperature`` > 0:
    U(0, 1) [N, B, V] for the Gumbel noise; ``random``: U(0, 1) [N, B], last).

    Returns, per row, the block offsets best first (the masks first: :func:`~mdm_sampling.best_first`) [N, B], the
    predicted token at each [N, B] and, with ``threshold``, whether its probability reaches it [N, B]. The row
    takes the first of them that its schedule says, or with ``threshold`` the first and those that reach it."""
    wide = logits.to(wide_float(logits.device))
    forbidden = forbid_mask(wide, mask_token_id)
    predicted = (forbidden if temperature == 0 else with_gumbel(forbidden, temperature, noise[0])).argmax(-1)
    token_prob = token_probs(wide, predicted)  # [N, B]; the mask keeps its share, as in the reference
    confidence = token_prob if remasking == "low_confidence" else noise[-1]
    order = best_first(masked_confidence(confidence, block_ids == mask_token_id))  # [N, B]
    chosen = (order, predicted.gather(-1, order))
    return chosen if threshold is None else (*chosen, token_prob.gather(-1, order) >= threshold)


def llada_row(canvas: Canvas, config: LLaDAConfig, generator: torch.Generator | None) -> CanvasStep[DecodeResult]:
    """One prompt's LLaDA decode as a row program (see mdm.canvas_row); its choice is made for every row waiting on
    one at once (:func:`choose`)."""
    decision = functools.partial(choose, mask_token_id=canvas.mask_token_id, threshold=config.threshold,
                                 temperature=config.temperature, remasking=config.remasking)
    key = (choose, *decision.keywords.items())  # rows of equal settings decide together
    cond = CanvasPasses(canvas.stats, config.use_cache, config.dual_cache)
    uncond = None
    if config.cfg_scale > 0:  # its K/V in the store columns after the conditional stream's
        uncond = CanvasPasses(canvas.stats, config.use_cache, config.dual_cache, base=canvas.length)
    for block in canvas.blocks(config.block_length):
        for passes in (cond, uncond):
            if passes is not None:
                passes.start_block(block)
        schedule = even_schedule(block.length, config.steps_per_block)  # a block starts all masked
        for step in canvas.steps(block, config.steps_per_block, config.threshold, config.use_cache):
            # 1) predict
            logits = yield from guided_logits(cond, uncond, canvas, block, config.cfg_scale)  # [B, V]
            noise = []  # the row's draws, in the reference's order
            if config.temperature > 0:
                noise.append(uniform(tuple(logits.shape), generator, canvas.device))
            if config.remasking == "random":
                noise.append(uniform((block.length,), generator, canvas.device))
            # 2) rank and 3) unmask: every waiting row's at once
            count = schedule[step] if step < len(schedule) else 0  # past it: the cached step after a full block
            ranked, tokens, *reaches = yield from decide(key, decision, logits, canvas.ids[block.start: block.end],
                                                         *noise)
            n_masked = canvas.mask_count(block)
            # Fast-dLLM: the best mask, and every other whose probability reaches the threshold
            kept = kept_places(n_masked, count, reaches[0] if reaches else None)
            canvas.commit(block, step, [ranked[i] for i in kept], [tokens[i] for i in kept])
    return canvas.result()
