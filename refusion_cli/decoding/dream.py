"""Dream's sampler: the whole response masked, unmasked over a linear timestep schedule.

Token ids in, token ids out. Dream is trained like an AR model, so its logits are *shifted*: the
token at position i is predicted from the logits of position i-1 (the prompt is never empty, so
position 0 is never needed). Timesteps run linspace(1, eps, steps + 1); at step i (t -> s):

1) predict   one pass; the masked positions' tokens are sampled (argmax at temperature 0,
             after optional top-p / top-k filtering), in the logits' own dtype as the reference
             (bf16 for a bf16 model). The mask token keeps its share of the probabilities but is
             never a prediction.
2) unmask    ``origin``: every mask independently with probability 1 - s/t (all at the last step).
             ``maskgit_plus`` (top probability), ``topk_margin`` (p1 - p2), ``entropy`` (-H):
             rank the masks by that confidence and unmask int(masks * (1 - s/t)) of them (all at
             the last step) - the top ones, or drawn from softmax(confidence / alg_temp).
             With ``threshold`` (Fast-dLLM): the best one plus every other whose token has
             probability >= threshold, until no mask is left; without a cache, at most as many
             tokens by the end of step i as the first i + 1 steps of an even split of the block over
             ``steps`` allow (masks / steps a step when they divide), and no limit from the last
             step on.

Dream decodes the whole response as one block; ``block_length`` (Fast-dLLM's Dream) cuts it into
semi-autoregressive blocks, each with its own timestep schedule of steps / blocks steps.

``use_cache`` (Fast-dLLM's cached Dream sampler) keeps, from each block's first pass, the K/V of the
prefix (every position left of the block), and ``dual_cache`` also the K/V right of the block; later
steps feed the block and what follows it (prefix cache) or the block alone (dual cache). With a
cache the block's first step, the full pass, unmasks the block's first position only (the token its
shifted logits predict), unless the schedule gives the block a single step, which takes every mask;
the schedule's steps 1, 2, ... follow, or the threshold rule. A cached step reads the fed positions'
logits shifted within the call, so the block's first position would read its own logits; it is
never masked by then. Only the logits that predict a mask are computed (on a cached full pass, only
those of the block's first mask). :func:`dream_row` is one prompt's program; ``engine.run_decoder``
decodes a list of prompts as a batch, each row as alone (see mdm). Without draws (temperature 0, a
confidence ranking, no ``alg_temp``: Fast-dLLM's Dream) and with at most a chunk of reads, steps 1) and 2)
are one function for every row of a step (:func:`rank_choice`, yielded with ``readback.decide``); a draw
stays the row's own, from its own generator.

Logits memory: a step whose reads exceed ``mdm.LOGITS_CHUNK`` is predicted a chunk at a time from the
head's input, so a row never holds more than a chunk of logits; the tokens are those of one pass
(``docs/engine.md``, "Dream's logits a chunk at a time").
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from refusion_cli.decoding.batching import ragged_rows, side_by_side, uniform
from refusion_cli.decoding.config import ConfigError, check_non_negative, check_positive, check_probability
from refusion_cli.decoding.canvas import Canvas, CanvasStep, even_schedule
from refusion_cli.decoding.mdm import CanvasPasses, ReadLogits, logit_chunks, one_chunk, take_rows
from refusion_cli.decoding.mdm_sampling import (argmax_without, best_first, check_blocks, check_fast_options,
                                               choose_positions, kept_places, sample)
from refusion_cli.decoding.readback import decide, device_index, read
from refusion_cli.decoding.stats import DecodeResult, wide_float

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def check_filters(top_p: float | None, top_k: int | None) -> None:
    """The top-p and top-k filters of the sampled tokens (None: off)."""
    if top_p is not None:
        check_probability("top_p", top_p)
        if top_p == 0:
            raise ConfigError("top_p must be > 0 (use None or 1 for no filtering)")
    if top_k is not None:
        check_positive("top_k", top_k)


@dataclass(frozen=True)
class DreamConfig:
    """Dream's sampler settings; defaults are the ``diffusion_generate`` call of Dream's README."""

    gen_length: int = 512  # response length in tokens (max_new_tokens)
    steps: int = 512  # denoising steps over the whole response
    alg: str = "entropy"  # unmasking order: "origin", "maskgit_plus", "topk_margin" or "entropy"
    alg_temp: float = 0.0  # > 0: draw positions from softmax(confidence / alg_temp) instead of the top ones
    eps: float = 1e-3  # last timestep of linspace(1, eps, steps + 1)
    temperature: float = 0.2  # token sampling temperature (0 = argmax)
    top_p: float | None = 0.95  # nucleus filtering before sampling (None or 1 = off)
    top_k: int | None = None  # top-k filtering before sampling (None = off)
    block_length: int | None = None  # None = one block, as Dream; else Fast-dLLM's semi-AR blocks
    threshold: float | None = None  # Fast-dLLM parallel unmasking: keep every token with p >= threshold
    use_cache: bool = False  # Fast-dLLM prefix KV cache (approximate for bidirectional models)
    dual_cache: bool = False  # with use_cache: also cache the K/V right of the block (Fast-dLLM's dual cache)

    def __post_init__(self) -> None:
        check_blocks(self.gen_length, self.steps, self.block_tokens)
        if self.alg not in ALGORITHMS:
            raise ConfigError(f"alg must be one of {', '.join(ALGORITHMS)}, got {self.alg!r}")
        check_non_negative("alg_temp", self.alg_temp)
        if not 0.0 < self.eps < 1.0:
            raise ConfigError(f"eps must be in (0, 1), got {self.eps}")
        check_filters(self.top_p, self.top_k)
        check_fast_options(self.threshold, self.use_cache, self.dual_cache, self.temperature)
        if self.threshold is not None and self.alg == "origin":
            raise ConfigError("threshold needs a confidence ranking: use alg maskgit_plus, topk_margin or entropy")
        if self.threshold is not None and self.alg_temp > 0:
            raise ConfigError("threshold and alg_temp are two ways to choose positions: set only one")

    @property
    def block_tokens(self) -> int:
        """The block size actually used (the whole response when block_length is None)."""
        return self.gen_length if self.block_length is None else self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // (self.gen_length // self.block_tokens)


# Fast-dLLM as Table 1's Dream row runs it (Fast-dLLM's evaluation scripts): greedy, ranked by the top probability
# (its confidence_threshold: maskgit_plus, no top-p), blocks of 32, threshold 0.9, prefix and dual cache; Table 1's
# 512-token budget, and steps one a token, as registry.length_settings makes them (a threshold leaves them unused)
FAST_DLLM_PRESETS: Mapping[str, DreamConfig] = MappingProxyType({
    "fast-dllm": DreamConfig(gen_length=512, steps=512, alg="maskgit_plus", temperature=0.0, top_p=None,
                             block_length=32, threshold=0.9, use_cache=True, dual_cache=True)})


def filter_logits(logits: torch.Tensor, top_p: float | None, top_k: int | None) -> torch.Tensor:
    """Logits [n, V] with everything outside the top-p nucleus and the top-k set made impossible."""
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        mass = ordered.softmax(-1).cumsum(-1)  # [n, V]: mass of the best j + 1 tokens
        drop_sorted = torch.zeros_like(mass, dtype=torch.bool)
        # token j goes when the strictly better ones already hold more than top_p: the smallest prefix
        # whose mass exceeds top_p stays (read from the running sum, as the reference: in bf16,
        # subtracting a token's own probability from it would round differently)
        drop_sorted[..., 1:] = mass[..., :-1] > top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    if top_k is not None:
        kth_best = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    return logits


def predict_tokens(logits: torch.Tensor, config: DreamConfig, mask_token_id: int,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1) Sample a token for each row of ``logits`` [n, V]; return (tokens, their probabilities, confidence).

    Computed in the logits' own dtype, as the reference (bf16 for a bf16 model). The probabilities
    and confidences are the reference's, the mask token keeping its share; the mask itself is never
    drawn: a row draws among the other tokens of its nucleus, or, if only the mask is left there,
    takes its best other token.
    """
    if logits.shape[0] == 0:  # nothing to predict (origin: no mask goes this step)
        empty = logits.new_zeros(0)
        return empty.long(), empty, empty
    if config.temperature > 0:
        logits = logits / config.temperature
    probs = filter_logits(logits, config.top_p, config.top_k).softmax(-1)  # [n, V]
    weights = probs.clone()
    weights[:, mask_token_id] = 0
    only_mask = weights.sum(-1) == 0  # [n]: the filtering left nothing but the mask
    # such a row's weights are all 0: adding 1 at its best other token (0 to every other row) needs no wait
    weights.scatter_add_(-1, argmax_without(logits, mask_token_id)[:, None], only_mask[:, None].to(weights.dtype))
    if config.temperature > 0:
        tokens = sample(weights.to(torch.promote_types(weights.dtype, torch.float32)), 1, generator).squeeze(-1)
    else:
        tokens = weights.argmax(-1)
    token_prob = probs.gather(-1, tokens[:, None]).squeeze(-1)
    if config.alg == "topk_margin":
        best_two = probs.topk(2, dim=-1).values
        confidence = best_two[:, 0] - best_two[:, 1]
    elif config.alg == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(-1)  # -H
    else:
        confidence = token_prob
    return tokens, token_prob, confidence


def predict_chunks(logits: ReadLogits, config: DreamConfig, mask_token_id: int,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1) :func:`predict_tokens` on ``logits``' rows, ``mdm.LOGITS_CHUNK`` at a time: (tokens, their probabilities,
    confidence) [n]; a chunk's logits are computed, and reduced, once the previous chunk's are gone."""
    parts = []
    for chunk in logit_chunks(logits):
        parts.append(predict_tokens(chunk, config, mask_token_id, generator))
        del chunk  # gone before the next chunk's logits are computed
    tokens, token_prob, confidence = zip(*parts)
    return torch.cat(tokens), torch.cat(token_prob), torch.cat(confidence)


def transfer_fractions(steps: int, eps: float) -> list[float]:
    """2) 1 - s/t of each step (t -> s) of linspace(1, eps, steps + 1), in float32 as the reference, on the host."""
    timesteps = torch.linspace(1, eps, steps + 1)  # float32, as the reference
    return (1 - timesteps[1:] / timesteps[:-1]).tolist()


def transfer_count(n_masked: int, step: int, fractions: list[float]) -> int:
    """2) How many masks go at ``step``: int(n * (1 - s/t)) (the product in float32), all of them at the last."""
    if step == len(fractions) - 1:
        return n_masked
    return int(struct.unpack("f", struct.pack("f", n_masked * fractions[step]))[0])


def rank_choice(sizes: list[int], logits: torch.Tensor, *, config: DreamConfig, mask_token_id: int,
                head: torch.nn.Module | None = None) -> tuple[torch.Tensor, ...]:
    """1) and 2) without draws (greedy, a confidence ranking, no ``alg_temp``), for every row waiting on it at once:
    ``logits`` [sum n, V] of each row's n reads (the rows end to end, ``sizes``; with ``head``, the hidden states
    [sum n, H] it makes them from). Returns each row's reads best first (places in its row; equal ones leftmost
    first, as :func:`~mdm_sampling.choose_positions`), the token predicted at each and, with ``threshold``,
    whether its probability reaches it, each [sum n]."""
    if head is not None:
        logits = head(logits)
    tokens, token_prob, confidence = predict_tokens(logits, config, mask_token_id, None)  # [sum n]
    rows, places, first_of = ragged_rows(sizes, logits.device)
    ranked = side_by_side(confidence.to(wide_float(logits.device)), sizes, rows, places, float("-inf"))
    order = best_first(ranked)[rows, places]  # [sum n]: each row's first n are its reads, best first
    at = order + first_of
    chosen = (order, tokens[at])
    return chosen if config.threshold is None else (*chosen, token_prob[at] >= config.threshold)


def dream_row(canvas: Canvas, config: DreamConfig, generator: torch.Generator | None) -> CanvasStep[DecodeResult]:
    """One prompt's Dream decode as a row program (see mdm.canvas_row). Without draws its choice is made for every
    row waiting on one at once (:func:`rank_choice`) where its reads' logits fit one chunk; otherwise, and with
    ``origin``, top-p sampling or ``alg_temp``, the row makes it alone."""
    passes = CanvasPasses(canvas.stats, config.use_cache, config.dual_cache, shifted=True, chunked=True)
    fractions = transfer_fractions(config.steps_per_block, config.eps)
    mask_token_id = canvas.mask_token_id
    greedy = config.temperature == 0 and config.alg_temp == 0 and config.alg != "origin"
    for block in canvas.blocks(config.block_tokens):
        passes.start_block(block)
        n_masked = block.length  # a block starts all masked
        # without a cache, a threshold step may have unmasked at most unmasked_by[i] of the block by the end of step i
        unmasked_by = list(itertools.accumulate(even_schedule(n_masked, config.steps_per_block)))
        for step in canvas.steps(block, config.steps_per_block, config.threshold, config.use_cache):
            where = canvas.masked_offsets(block)  # block offsets of the masks, ascending
            # the cached sampler's full pass unmasks the block's first position only
            first_only = config.use_cache and step == 0 and (config.threshold is not None or config.steps_per_block > 1)
            reads = where[:1] if first_only else where
            ranks = bool(where) and not first_only and config.alg != "origin"  # a step that ranks its masks
            count = transfer_count(len(where), step, fractions) if ranks and config.threshold is None else 0
            limit = None  # with a threshold and no cache: the most masks this step may unmask
            if config.threshold is not None and not config.use_cache:
                limit = unmasked_by[min(step, len(unmasked_by) - 1)] - (n_masked - len(where))
            # the logits [n, V] of ``reads`` (the model's dtype), or their head input for predict_chunks
            logits = yield from passes(canvas.ids, [block.start + offset for offset in reads])
            if greedy and where and one_chunk(logits):
                # every waiting row's choice at once (from the head's input where the call kept it: a chunk's worth)
                inputs, head = (logits, None) if isinstance(logits, torch.Tensor) else (logits.states, logits.head)
                decision = functools.partial(rank_choice, config=config, mask_token_id=mask_token_id, head=head)
                ranked, best_tokens, *reaches = yield from decide((rank_choice, config, mask_token_id, head), decision,
                                                                  inputs, ragged=True)
                kept = (kept_places(len(where), 1, None) if first_only
                        else kept_places(len(where), count, reaches[0] if reaches else None, limit))
                canvas.commit(block, step, [where[ranked[j]] for j in kept], [best_tokens[j] for j in kept])
                continue
            masks = device_index(where, canvas.device)  # ``where`` on the device
            taken = None
            if not where:  # the cached step after a block its full pass finished
                picked, tokens = masks, masks
            elif first_only:
                picked = masks[:1]
                tokens = predict_chunks(logits, config, mask_token_id, generator)[0]
            elif config.alg == "origin":
                # 2) each mask goes with probability 1 - s/t; 1) only those get a token
                chosen = list(range(len(where)))
                if step < len(fractions) - 1:
                    goes, = yield from read(uniform((len(where),), generator, canvas.device) < fractions[step])
                    chosen = [row for row, going in enumerate(goes) if going]
                picked = device_index([where[row] for row in chosen], canvas.device)
                tokens = predict_chunks(take_rows(logits, chosen), config, mask_token_id, generator)[0]
            else:
                # 1) predict every mask (as the reference), 2) unmask the best ranked
                tokens, token_prob, confidence = predict_chunks(logits, config, mask_token_id, generator)
                rows, taken = choose_positions(confidence, token_prob, torch.ones_like(masks, dtype=torch.bool),
                                               n_masked=len(where), count=count, threshold=config.threshold,
                                               limit=limit, alg_temp=config.alg_temp, generator=generator)
                picked, tokens = masks[rows], tokens[rows]
            yield from canvas.unmask(block, step, picked, tokens, taken)
    return canvas.result()
