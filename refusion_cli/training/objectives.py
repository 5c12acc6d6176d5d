"""Training data construction per objective, batching, and the loss.

One training example is a prompt and a response (the response ends with EOS). Each objective turns
it into one model input row, a :class:`Sample`: token ids, their true position ids, and per-token
labels with a loss weight. ``labels[i]`` is scored against the logits at buffer index ``i`` (the
shift, where an objective has one, is already applied), so :func:`compute_loss` is the same for
every objective; only the attention (causal or bidirectional) differs.

- ``refusion`` (docs/training.md): the response is cut into slots of k tokens; each slot is masked with
  probability p. The buffer is the prompt, the clean slots in random order, then the masked slots
  (all ``<|mask|>``, in position order), each token at its true position, plain causal attention
  over the buffer order. A clean token predicts the next token of its own slot; a masked token
  predicts the original token at its own position.
- ``ar``: next-token prediction of the response (the last prompt token predicts the first response
  token, the second-to-last response token predicts EOS).
- ``llada``: each response token is masked with probability p; bidirectional attention; a masked
  token predicts the original token at its position. As in LLaDA's SFT, responses are first padded
  with EOS to a common length (:func:`pad_with_eos`; the padding is masked and scored like any
  response token), so the model learns to fill the rest of a fixed-length canvas with EOS.
- ``dream``: LLaDA's masking and padding with *shifted* labels: the masked token at position i is
  scored from the logits at position i-1, so a model initialised from an AR checkpoint keeps its
  next-token head (Dream is trained this way from Qwen2.5).

Per example, the loss is ``ar_part + mdm_part`` with ``ar_part`` = the mean CE over the AR-labelled
tokens and ``mdm_part`` = Σ CE(masked token) / p / response length; the batch loss is the mean over
examples. Averaging per example (not per token) keeps the loss of a global batch independent of
how it is split over processes and gradient-accumulation steps.

Randomness comes only from the ``torch.Generator`` passed in: the same generator state gives the
same sample. Prompts are never masked and never scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F

from refusion_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

SLOT_SIZES = (4, 8, 16, 32)  # k is drawn uniformly from these, once per example
MASK_EPSILON = 1e-3  # ε: the floor of the masking probability p = (1 - ε) t + ε
IGNORE_INDEX = -100  # label of a token that is not scored


class LossKind(IntEnum):
    """Which part of the loss a labelled token belongs to."""

    NONE = 0  # not scored (prompt, padding, the last token of a clean slot)
    AR = 1  # next-token prediction (clean slots; the whole response for `ar`)
    MDM = 2  # a masked token predicting itself


_NONE, _AR, _MDM = int(LossKind.NONE), int(LossKind.AR), int(LossKind.MDM)  # plain ints for building lists fast
_NUMPY_DTYPES = {torch.long: np.int64, torch.int8: np.int8, torch.bool: np.bool_}


def tensor_of(values: Sequence[int] | Sequence[bool], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 1-D tensor of Python ints (or bools), equal to ``torch.tensor(values, dtype=dtype)``.

    Goes through NumPy: ``torch.tensor`` converts a list element by element, about 10x slower, and a
    training step builds four such tensors per example.
    """
    return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))


@dataclass(frozen=True)
class Example:
    """One tokenized training record."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]  # ends with EOS

    def __post_init__(self) -> None:
        if not self.response_ids:
            raise ValueError("an example needs at least one response token (the EOS)")


@dataclass(frozen=True)
class Sample:
    """One model input row, ready to be batched. All tensors are 1-D of the same length S."""

    input_ids: torch.Tensor  # [S] long
    position_ids: torch.Tensor  # [S] long, the true position of each token
    labels: torch.Tensor  # [S] long, IGNORE_INDEX where not scored; compared with the logits at the same index
    loss_weights: torch.Tensor  # [S] float64, the factor on each token's CE (0 where not scored)
    loss_kinds: torch.Tensor  # [S] int8, LossKind per token
    mask_prob: float | None = None  # p, for the masking objectives
    slot_size: int | None = None  # k, for `refusion`


@dataclass(frozen=True)
class RefusionPlan:
    """The random choices behind one `refusion` sample."""

    slot_size: int  # k
    mask_prob: float  # p
    masked: tuple[bool, ...]  # one flag per slot, in position order
    clean_order: tuple[int, ...]  # the clean slots' indices, in the order they are laid out


def mask_probability(t: float) -> float:
    """p = (1 - ε) t + ε: the probability of masking, never below ε."""
    return (1.0 - MASK_EPSILON) * t + MASK_EPSILON


def draw_mask_probability(generator: torch.Generator) -> float:
    """p for t ~ U(0, 1)."""
    t = torch.rand((), generator=generator, dtype=torch.float64).item()
    return mask_probability(t)


def slot_bounds(response_length: int, slot_size: int) -> list[tuple[int, int]]:
    """[start, end) offsets of the slots of k tokens covering the response (the last may be shorter)."""
    return [(start, min(start + slot_size, response_length)) for start in range(0, response_length, slot_size)]


def draw_refusion_plan(response_length: int, generator: torch.Generator) -> RefusionPlan:
    """Draw k, p, the masked slots and the order of the clean slots (in this order, from ``generator``)."""
    slot_size = SLOT_SIZES[int(torch.randint(len(SLOT_SIZES), (), generator=generator))]
    mask_prob = draw_mask_probability(generator)
    n_slots = len(slot_bounds(response_length, slot_size))
    masked = (torch.rand(n_slots, generator=generator, dtype=torch.float64) < mask_prob).tolist()
    clean = [i for i, is_masked in enumerate(masked) if not is_masked]
    permutation = torch.randperm(len(clean), generator=generator).tolist()
    return RefusionPlan(slot_size, mask_prob, tuple(masked), tuple(clean[i] for i in permutation))


def layout_refusion(example: Example, plan: RefusionPlan, mask_id: int) -> Sample:
    """Lay out the buffer: prompt, clean slots in ``plan.clean_order``, masked slots in position order.

    Built slot by slot with list slices, one tensor per field at the end (a per-token loop and
    ``torch.tensor`` on lists took most of the data time of a step).
    """
    prompt, response = example.prompt_ids, example.response_ids
    offset = len(prompt)  # true position of response token 0
    slots = slot_bounds(len(response), plan.slot_size)
    if len(plan.masked) != len(slots) or sorted(plan.clean_order) != [i for i, m in enumerate(plan.masked) if not m]:
        raise ValueError("the plan does not match the response's slots")
    ids, positions, labels, kinds = list(prompt), list(range(offset)), [IGNORE_INDEX] * offset, [_NONE] * offset
    for slot in plan.clean_order:  # 1) clean slots: each token predicts the next token of its own slot
        start, end = slots[slot]
        ids += response[start:end]
        positions += range(offset + start, offset + end)
        labels += response[start + 1:end]
        labels.append(IGNORE_INDEX)  # the slot's last token has no label
        kinds += [_AR] * (end - start - 1)
        kinds.append(_NONE)
    for slot, is_masked in enumerate(plan.masked):  # 2) masked slots: each mask predicts the token at its position
        if is_masked:
            start, end = slots[slot]
            ids += [mask_id] * (end - start)
            positions += range(offset + start, offset + end)
            labels += response[start:end]
            kinds += [_MDM] * (end - start)
    kinds_tensor = tensor_of(kinds, torch.int8)
    n_ar = int((kinds_tensor == LossKind.AR).sum())
    weights = torch.zeros(len(ids), dtype=torch.float64)
    if n_ar:
        weights[kinds_tensor == LossKind.AR] = 1.0 / n_ar  # mean CE over the clean-slot labels
    weights[kinds_tensor == LossKind.MDM] = 1.0 / (plan.mask_prob * len(response))  # Σ CE / p / response length
    return Sample(tensor_of(ids), tensor_of(positions), tensor_of(labels), weights, kinds_tensor,
                  mask_prob=plan.mask_prob, slot_size=plan.slot_size)


def build_refusion(example: Example, mask_id: int, generator: torch.Generator) -> Sample:
    """The hybrid objective (docs/training.md)."""
    return layout_refusion(example, draw_refusion_plan(len(example.response_ids), generator), mask_id)


def build_ar(example: Example, mask_id: int, generator: torch.Generator) -> Sample:
    """Next-token prediction of every response token (``mask_id`` and ``generator`` are unused)."""
    prompt, response = example.prompt_ids, example.response_ids
    ids = tensor_of((*prompt, *response))
    labels = torch.full((len(ids),), IGNORE_INDEX)
    start = len(prompt) - 1  # the token before response[0]: the last prompt token (or none for an empty prompt)
    targets = ids[len(prompt):]
    if start < 0:  # no prompt: response[0] has nothing to be predicted from
        targets, start = targets[1:], 0
    labels[start:start + targets.numel()] = targets
    kinds = torch.where(labels != IGNORE_INDEX, int(LossKind.AR), int(LossKind.NONE)).to(torch.int8)
    weights = (kinds == LossKind.AR).to(torch.float64) / max(targets.numel(), 1)  # mean CE over the response
    return Sample(ids, torch.arange(len(ids)), labels, weights, kinds)


def layout_llada(example: Example, masked: Sequence[bool], mask_prob: float, mask_id: int) -> Sample:
    """Prompt then response with the ``masked`` response tokens replaced by ``mask_id``, in position order."""
    prompt, response = example.prompt_ids, example.response_ids
    if len(masked) != len(response):
        raise ValueError("one mask flag per response token is needed")
    offset = len(prompt)
    flags = tensor_of([False] * offset + list(masked), torch.bool)
    original = tensor_of((*prompt, *response))
    ids = torch.where(flags, mask_id, original)
    labels = torch.where(flags, original, IGNORE_INDEX)
    kinds = torch.where(flags, int(LossKind.MDM), int(LossKind.NONE)).to(torch.int8)
    weights = flags.to(torch.float64) / (mask_prob * len(response))  # Σ CE / p / response length
    return Sample(ids, torch.arange(len(ids)), labels, weights, kinds, mask_prob=mask_prob)


def build_llada(example: Example, mask_id: int, generator: torch.Generator) -> Sample:
    """Masked diffusion (LLaDA): each response token masked independently with probability p."""
    mask_prob = draw_mask_probability(generator)
    masked = (torch.rand(len(example.response_ids), generator=generator, dtype=torch.float64) < mask_prob).tolist()
    return layout_llada(example, masked, mask_prob, mask_id)


def shift_left(sample: Sample) -> Sample:
    """The same row with every label (and its weight and kind) moved one index left: the logits at
    position i-1 score the token at position i, as Dream predicts. Needs a non-empty prompt, so the
    first response token is scored from the last prompt token."""
    def shifted(values: torch.Tensor, fill: float | int) -> torch.Tensor:
        return torch.cat([values[1:], values.new_full((1,), fill)])

    return Sample(sample.input_ids, sample.position_ids, shifted(sample.labels, IGNORE_INDEX),
                  shifted(sample.loss_weights, 0.0), shifted(sample.loss_kinds, int(LossKind.NONE)),
                  mask_prob=sample.mask_prob)


def build_dream(example: Example, mask_id: int, generator: torch.Generator) -> Sample:
    """Dream's masked diffusion: LLaDA's masking (the same draws) with shifted labels."""
    if not example.prompt_ids:
        raise ValueError("the dream objective needs a prompt: the first response token is read from the last prompt token")
    return shift_left(build_llada(example, mask_id, generator))


def pad_with_eos(example: Example, response_length: int) -> Example:
    """The example with its response padded to ``response_length`` tokens by repeating its final EOS."""
    missing = response_length - len(example.response_ids)
    if missing <= 0:
        return example
    return Example(example.prompt_ids, example.response_ids + (example.response_ids[-1],) * missing)


@dataclass(frozen=True)
class Objective:
    name: str
    bidirectional: bool  # attention over the whole (unpadded) row instead of causal over the buffer order
    build: Callable[[Example, int, torch.Generator], Sample]  # (example, mask id, generator) -> sample
    help: str
    eos_padding: bool = False  # responses are padded with EOS to the longest one first (LLaDA's SFT)
    shifted: bool = False  # masked tokens are scored from the position before them (Dream)


OBJECTIVES: dict[str, Objective] = {
    "refusion": Objective("refusion", False, build_refusion,
                          "hybrid slot objective: clean slots shuffled and AR-scored, masked slots denoised"),
    "ar": Objective("ar", False, build_ar, "next-token prediction on the response"),
    "llada": Objective("llada", True, build_llada, "masked diffusion with bidirectional attention",
                       eos_padding=True),
    "dream": Objective("dream", True, build_dream, "masked diffusion with shifted labels (token i read at "
                       "position i-1), bidirectional attention; start from an AR model", eos_padding=True,
                       shifted=True),
}


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise UserError(f"unknown objective '{name}'; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def collate(samples: Sequence[Sample], pad_id: int, weights_dtype: torch.dtype = torch.float64
            ) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch. Padding is never scored and never attended to by real tokens.

    ``weights_dtype``: the loss weights' dtype (float64; float32 for Apple's MPS, which has no float64).
    """
    lengths = torch.tensor([s.input_ids.numel() for s in samples])
    width = int(lengths.max())

    def stack(field: str, fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((len(samples), width), fill, dtype=dtype)
        for row, sample in enumerate(samples):
            values = getattr(sample, field)
            out[row, :values.numel()] = values
        return out

    return {
        "input_ids": stack("input_ids", pad_id, torch.long),  # [B, S]
        "position_ids": stack("position_ids", 0, torch.long),  # [B, S]
        "labels": stack("labels", IGNORE_INDEX, torch.long),  # [B, S]
        "loss_weights": stack("loss_weights", 0.0, weights_dtype),  # [B, S]
        "loss_kinds": stack("loss_kinds", int(LossKind.NONE), torch.int8),  # [B, S]
        "lengths": lengths,  # [B] real tokens per row
    }


def attention_allowed(lengths: torch.Tensor, width: int, bidirectional: bool) -> torch.Tensor:
    """[B] row lengths -> [B, 1, S, S] bool: query i may attend to key j.

    Causal: j <= i over the buffer order (with right padding a real token never sees a pad).
    Bidirectional: every real token; a pad query sees itself too, so no row is empty.
    """
    index = torch.arange(width, device=lengths.device)
    if bidirectional:
        real = index[None, :] < lengths[:, None]  # [B, S]
        allowed = real[:, None, :] | torch.eye(width, dtype=torch.bool, device=lengths.device)[None]
    else:
        allowed = (index[None, :] <= index[:, None])[None].expand(lengths.numel(), width, width)
    return allowed[:, None]


def broadcast_attention_allowed(lengths: torch.Tensor, width: int, bidirectional: bool) -> torch.Tensor:
    """The rule of :func:`attention_allowed` for every real query, as a mask that broadcasts to [B, 1, S, S].

    Causal: [1, 1, S, S], one triangle for the whole batch. Bidirectional: [B, 1, 1, S], each row's real
    keys (a pad query then sees the real tokens rather than itself; no real token reads it, and it is
    never scored). The dense mask cost B times the memory, in every layer (the attention backend turns
    a bool mask into a float copy per call and keeps it for the backward pass).
    """
    index = torch.arange(width, device=lengths.device)
    if bidirectional:
        return (index[None, :] < lengths[:, None])[:, None, None, :]
    return (index[None, :] <= index[:, None])[None, None]


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / FSDP / DeepSpeed wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def model_attention_mask(model: torch.nn.Module, allowed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The explicit 4-D mask for every attention layer type, in the form the attention backend takes.

    Passing a dict bypasses transformers' own mask construction, which would misread out-of-order
    position ids as packed sequences (docs/training.md).
    """
    base = _base_model(model)
    config = cast("PreTrainedConfig", base.config)
    if config._attn_implementation == "sdpa":
        mask = allowed
    else:  # eager: additive float mask
        dtype = next(base.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return {kind: mask for kind in layer_types}


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar, differentiable: mean over the batch of (ar + mdm)
    ar_loss: torch.Tensor  # scalar, detached: the mean AR part
    mdm_loss: torch.Tensor  # scalar, detached: the mean denoising part


def weighted_losses(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, S, V] -> per-example (ar_part [B], mdm_part [B]) from the batch's labels and weights."""
    labels = batch["labels"]
    scored = labels != IGNORE_INDEX  # [B, S]
    dtype = torch.promote_types(logits.dtype, torch.float32)  # CE in at least float32 (float64 stays float64)
    ce = torch.zeros(labels.shape, dtype=dtype, device=logits.device)
    ce[scored] = F.cross_entropy(logits[scored].to(dtype), labels[scored], reduction="none")
    weighted = ce * batch["loss_weights"].to(dtype)  # [B, S]
    kinds = batch["loss_kinds"]
    ar = (weighted * (kinds == LossKind.AR)).sum(dim=1)
    mdm = (weighted * (kinds == LossKind.MDM)).sum(dim=1)
    return ar, mdm


def example_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor], objective: Objective | str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over a collated batch -> each example's (ar_part [B], mdm_part [B]) of the loss."""
    if isinstance(objective, str):
        objective = get_objective(objective)
    input_ids = batch["input_ids"]
    allowed = broadcast_attention_allowed(batch["lengths"], input_ids.shape[1], objective.bidirectional)
    out = model(input_ids=input_ids, position_ids=batch["position_ids"],
                attention_mask=model_attention_mask(model, allowed), use_cache=False)
    return weighted_losses(out.logits, batch)


def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], objective: Objective | str) -> LossParts:
    """The loss of docs/training.md (or of the baseline objective) over a collated batch: the mean over its examples."""
    ar, mdm = example_losses(model, batch, objective)
    return LossParts(loss=(ar + mdm).mean(), ar_loss=ar.detach().mean(), mdm_loss=mdm.detach().mean())
