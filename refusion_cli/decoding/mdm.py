"""What the masked-diffusion samplers (LLaDA, Dream) share: the canvas, the block loop, the model
calls with an optional prefix cache, and the choice of positions to unmask.

The *canvas* is the prompt followed by ``gen_length`` mask tokens ([P + L]); a sampler replaces
masks by tokens, block by block (left to right), a few per step, and never changes a token once it
is unmasked. Everything here is token ids; nothing knows of text.

Prefix cache (the Fast-dLLM option, ``use_cache=True``): the first step of a block is a full pass
over the canvas whose K/V of the *prefix* (prompt + finished blocks; Dream keeps one position
less, see dream.py) is kept; the block's later steps feed only the canvas right of the prefix,
with explicit position ids and an explicit 4-D mask (causal or full, as the model's config says),
and reuse that K/V. For a causal model this is exact (a token's K/V depends only on the
tokens left of it); for a bidirectional model it is an approximation, since the prefix's K/V was
computed while the current block was still (partly) masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from refusion_cli.decoding.cache import additive_mask, crop_to
from refusion_cli.decoding.config import ConfigError, check_non_negative, check_positive, check_probability
from refusion_cli.decoding.refusion import check_ids, prompt_tensor
from refusion_cli.decoding.stats import (DecodeResult, DecodeStats, EosIds, cache_argument, counted_forward,
                                         cut_after_eos, report_step, wide_float)


@dataclass
class MDMStep:
    """What one step of a masked-diffusion sampler unmasked (offsets count from the response start)."""

    block: int
    step: int  # step within the block, from 0
    offsets: list[int] = field(default_factory=list)  # response offsets unmasked by this step, in choice order
    tokens: list[int] = field(default_factory=list)  # the tokens written there


@dataclass(frozen=True)
class Block:
    index: int
    start: int  # first canvas position of the block
    end: int  # one past its last canvas position

    @property
    def length(self) -> int:
        return self.end - self.start


# ---------------------------------------------------------------------------------------------
# config checks shared by LLaDAConfig and DreamConfig


def check_blocks(gen_length: int, steps: int, block_length: int) -> None:
    """Blocks must tile the response and steps must split evenly over the blocks."""
    check_positive("gen_length", gen_length)
    check_positive("steps", steps)
    check_positive("block_length", block_length)
    if gen_length % block_length:
        raise ConfigError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    n_blocks = gen_length // block_length
    if steps % n_blocks:
        raise ConfigError(f"steps ({steps}) must be a multiple of the number of blocks "
                          f"(gen_length / block_length = {n_blocks})")


def check_fast_options(threshold: float | None, use_cache: bool, temperature: float) -> None:
    """The Fast-dLLM options and the sampling temperature."""
    if threshold is not None:
        check_probability("threshold", threshold)
    if not isinstance(use_cache, bool):
        raise ConfigError(f"use_cache must be true or false, got {use_cache!r}")
    check_non_negative("temperature", temperature)


# ---------------------------------------------------------------------------------------------
# the canvas


class Canvas:
    """The sequence being denoised (prompt + masked response), its counters and its trace."""

    def __init__(self, model: torch.nn.Module, prompt_ids: Sequence[int] | torch.Tensor, gen_length: int, *,
                 mask_token_id: int, eos_token_id: EosIds,
                 on_step: Callable[[MDMStep], None] | None = None):
        self.device = next(model.parameters()).device
        prompt = prompt_tensor(prompt_ids, self.device)
        check_ids(model, prompt, prompt.numel() + gen_length, mask_token_id=mask_token_id, eos_token_id=eos_token_id)
        self.prompt_length = prompt.numel()
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id
        masks = torch.full((gen_length,), mask_token_id, dtype=torch.long, device=self.device)
        self.ids = torch.cat([prompt, masks])  # [P + L]
        self.stats = DecodeStats()
        self.trace: list[MDMStep] = []
        self.on_step = on_step

    def blocks(self, block_length: int) -> Iterator[Block]:
        """The response's blocks, left to right."""
        end = self.ids.numel()
        for index, start in enumerate(range(self.prompt_length, end, block_length)):
            yield Block(index, start, min(start + block_length, end))

    def masked(self, block: Block) -> torch.Tensor:
        """[B] bool: which positions of ``block`` still hold the mask token."""
        return self.ids[block.start:block.end] == self.mask_token_id

    def steps(self, block: Block, steps: int, threshold: float | None) -> Iterator[int]:
        """Step indices for ``block``: exactly ``steps`` of them, or, with a threshold, until no mask is left."""
        step = 0
        while (step < steps) if threshold is None else bool(self.masked(block).any()):
            yield step
            step += 1

    def unmask(self, block: Block, step: int, offsets: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write ``tokens`` [n] at block offsets ``offsets`` [n] and record the step."""
        self.ids[block.start + offsets] = tokens
        response_offsets = (offsets + block.start - self.prompt_length).tolist()
        record = MDMStep(block.index, step, response_offsets, tokens.tolist())
        self.trace.append(record)
        report_step(self.stats, self.on_step, record)

    def result(self, seconds: float) -> DecodeResult:
        """The response cut after its first EOS, with the shared counters."""
        tokens = cut_after_eos(self.ids[self.prompt_length:].tolist(), self.eos_token_id)
        self.stats.seconds = seconds - self.stats.callback_seconds
        self.stats.tokens = len(tokens)
        return DecodeResult(tokens=tokens, stats=self.stats, trace=self.trace)


# ---------------------------------------------------------------------------------------------
# model calls


class CanvasPasses:
    """Counted model calls over a canvas, one block at a time; each call returns logits from ``window`` on.

    Without the cache every call is a full pass (the reference samplers). With it, the block's
    first call is a full pass that keeps the K/V of positions ``[0, window)``; later calls feed
    positions ``[window, T)`` only. One instance per conditioning stream (CFG needs two).
    """

    def __init__(self, model: torch.nn.Module, stats: DecodeStats, use_cache: bool):
        self.model = model
        self.stats = stats
        self.use_cache = use_cache
        self.causal = bool(getattr(model.config, "is_causal", True))
        self.dtype = next(model.parameters()).dtype
        self.layer_types = sorted(set(getattr(model.config, "layer_types", None) or ["full_attention"]))
        self.cache: DynamicCache | None = None
        self.window = 0

    def start_block(self, window: int) -> None:
        """Begin a block: the next call is a full pass; logits are returned from position ``window`` on."""
        self.window = window
        self.cache = None

    def __call__(self, canvas: torch.Tensor) -> torch.Tensor:
        """Logits [T - window, V] of canvas positions window..T-1, read unshifted, in the dtype the model
        computed them (bf16 for a bf16 model): each sampler widens them where its reference does."""
        if not self.use_cache:
            out = counted_forward(self.model, self.stats, input_ids=canvas[None], use_cache=False)
            return out.logits[0, self.window:]
        if self.cache is None:  # the block's first step: full pass, keep the prefix's K/V
            self.cache = DynamicCache(config=self.model.config)
            logits = self._cached_call(canvas, first=0)[self.window:]
        else:
            logits = self._cached_call(canvas[self.window:], first=self.window)
        crop_to(self.cache, self.window)  # drop the K/V of everything right of the prefix
        return logits

    def _cached_call(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        """Feed ``ids`` [Q] at positions first..first+Q-1 after the cache; return logits [Q, V]."""
        positions = torch.arange(first, first + ids.numel(), device=ids.device)  # [Q]
        keys = torch.arange(first + ids.numel(), device=ids.device)  # [first + Q]: cached then fed
        if self.causal:
            allowed = keys[None, :] <= positions[:, None]
        else:
            allowed = torch.ones(positions.numel(), keys.numel(), dtype=torch.bool, device=ids.device)
        mask = additive_mask(allowed, self.dtype)  # [1, 1, Q, first + Q]
        out = counted_forward(
            self.model,
            self.stats,
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask={kind: mask for kind in self.layer_types},
            use_cache=True,
            **cache_argument(self.model, self.cache),
        )
        return out.logits[0]


# ---------------------------------------------------------------------------------------------
# choosing what to unmask


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U(0, 1) float64 draws (float32 on MPS) from ``generator`` (on its own device), moved to ``device``."""
    noise_device = generator.device if generator is not None else device
    wide = wide_float(torch.device(device))
    return torch.rand(shape, generator=generator, dtype=wide, device=noise_device).to(device)


def sample(weights: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` indices per row of ``weights`` [..., V] drawn without replacement (on the generator's device)."""
    draw_device = generator.device if generator is not None else weights.device
    picked = torch.multinomial(weights.to(draw_device), count, replacement=False, generator=generator)
    return picked.to(weights.device)


def forbid_mask(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Logits with the mask token made impossible: a prediction must never be the mask itself."""
    logits = logits.clone()
    logits[..., mask_token_id] = float("-inf")
    return logits


def choose_positions(
    confidence: torch.Tensor,
    token_prob: torch.Tensor,
    masked: torch.Tensor,
    *,
    count: int,
    threshold: float | None,
    alg_temp: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Block offsets to unmask this step, best first ([n] long).

    ``confidence`` [B] ranks the masked positions (``masked`` [B]), ``token_prob`` [B] is the
    probability of each position's predicted token. With ``threshold`` (Fast-dLLM) the best
    position is always taken and every other masked one whose token probability is >= threshold;
    otherwise ``count`` positions: the top ``count``, or, with ``alg_temp`` > 0 (Dream), drawn
    from softmax(confidence / alg_temp). Equal confidences (frequent with bf16 probabilities) go
    leftmost first: torch.topk leaves the choice among ties unspecified (the CPU's differs from
    the GPU's), so the top ``count`` come from a stable sort instead.
    """
    ranked = torch.where(masked, confidence.to(wide_float(confidence.device)), float("-inf"))  # [B]
    if not bool(masked.any()):
        return torch.zeros(0, dtype=torch.long, device=masked.device)
    if threshold is not None:
        best = ranked.argmax()
        sure = masked & (token_prob >= threshold)
        sure[best] = False
        others = sure.nonzero().flatten()
        others = others[ranked[others].argsort(descending=True)]
        return torch.cat([best.view(1), others])
    count = min(count, int(masked.sum()))
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=masked.device)
    if alg_temp > 0:
        return sample(torch.softmax(ranked / alg_temp, dim=-1), count, generator)
    return ranked.sort(descending=True, stable=True).indices[:count]
