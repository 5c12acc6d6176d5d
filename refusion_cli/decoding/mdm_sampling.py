"""How a masked-diffusion sampler (LLaDA, Dream, D2F) steps, beside the canvas and the model calls of
:mod:`~refusion_cli.decoding.mdm`: its block and Fast-dLLM options checked, and the choice of the positions
each step unmasks (the noise drawn from the row's generator). Token ids and logits only.
"""

from __future__ import annotations

import torch

from refusion_cli.decoding.config import ConfigError, check_non_negative, check_positive, check_probability
from refusion_cli.decoding.stats import wide_float

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


def check_fast_options(threshold: float | None, use_cache: bool, dual_cache: bool, temperature: float) -> None:
    """The Fast-dLLM options and the sampling temperature."""
    if threshold is not None:
        check_probability("threshold", threshold)
    for name, value in (("use_cache", use_cache), ("dual_cache", dual_cache)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    if dual_cache and not use_cache:
        raise ConfigError("dual_cache extends the prefix cache: set use_cache=true with it")
    check_non_negative("temperature", temperature)


# ---------------------------------------------------------------------------------------------
# choosing what to unmask


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


def argmax_without(logits: torch.Tensor, token: int) -> torch.Tensor:
    """[n]: each row's argmax of ``logits`` [n, V] over every token but ``token`` (the first of equals), as
    ``forbid_mask(logits, token).argmax(-1)`` without copying the logits."""
    left, right = logits[:, :token], logits[:, token + 1:]
    if not left.shape[1] or not right.shape[1]:
        return right.argmax(-1) + token + 1 if left.shape[1] == 0 else left.argmax(-1)
    left_index, right_index = left.argmax(-1), right.argmax(-1)
    left_best, right_best = left.gather(-1, left_index[:, None]), right.gather(-1, right_index[:, None])
    return torch.where(left_best[:, 0] >= right_best[:, 0], left_index, right_index + token + 1)


def choose_positions(
    confidence: torch.Tensor,
    token_prob: torch.Tensor,
    masked: torch.Tensor,
    *,
    n_masked: int,
    count: int,
    threshold: float | None,
    limit: int | None = None,
    alg_temp: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block offsets to unmask this step, best first ([k] long), and which of them go ([k] bool; None: all),
    computed on the device without a wait.

    ``confidence`` [B] ranks the masked positions (``masked`` [B], ``n_masked`` of them), ``token_prob`` [B] is
    the probability of each position's predicted token. With ``threshold`` (Fast-dLLM) the best
    position is always taken and every other masked one whose token probability is >= threshold,
    among the ``limit`` best ranked (None: all); otherwise ``count`` positions: the top ``count``,
    or, with ``alg_temp`` > 0 (Dream), drawn from softmax(confidence / alg_temp). Equal confidences
    (frequent with bf16 probabilities) go leftmost first (:func:`best_first`).
    """
    ranked = masked_confidence(confidence, masked)  # [B]
    none = torch.zeros(0, dtype=torch.long, device=masked.device)
    if n_masked == 0:
        return none, None
    if threshold is not None:
        first = best_first(ranked)[: n_masked if limit is None else limit]
        taken = token_prob[first] >= threshold
        taken[0] = True
        return first, taken
    count = min(count, n_masked)
    if count == 0:
        return none, None
    if alg_temp > 0:
        return sample(torch.softmax(ranked / alg_temp, dim=-1), count, generator), None
    return best_first(ranked)[:count], None


def kept_places(n_masked: int, count: int, reaches: list[int] | None, limit: int | None = None) -> list[int]:
    """:func:`choose_positions`' rule on the host, for a step whose ``n_masked`` masks were ranked best first on the
    device: the places it unmasks, with a threshold (``reaches``: whether each one's token reaches it) the best
    and every other among the ``limit`` best (None: all) that reaches it, else the first ``count``."""
    if reaches is None:
        return list(range(min(count, n_masked)))
    return [j for j in range(min(n_masked, n_masked if limit is None else limit)) if j == 0 or reaches[j]]


def masked_confidence(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``confidence`` [..., B] at the ``masked`` positions, -inf elsewhere, in float64 (float32 on MPS)."""
    return torch.where(masked, confidence.to(wide_float(confidence.device)), float("-inf"))


def best_first(ranked: torch.Tensor) -> torch.Tensor:
    """The positions of ``ranked`` [..., B] best first along the last dimension, equal ones leftmost first
    (a stable sort: torch.topk leaves the order of ties unspecified, and the CPU's differs from the GPU's)."""
    return ranked.sort(dim=-1, descending=True, stable=True).indices
