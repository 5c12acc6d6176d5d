"""Batch and per-row helpers shared by every decoder: prompts checked and put on the model's device,
one generator and one ``on_step`` callback per row, and the sampling helpers (Gumbel argmax, token
probabilities).

Token ids in; this module knows nothing of text, tokenizers or any one decoder's algorithm. A batch
is a list or tuple of prompts (:func:`is_batch`); anything else is one prompt.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np
import torch

from refusion_cli.decoding.readback import device_index
from refusion_cli.decoding.stats import EosIds, eos_ids, wide_float
from refusion_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# ---------------------------------------------------------------------------------------------
# prompts and batches


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A prompt as a 1-D LongTensor on ``device`` ([P] or [1, P] accepted); empty prompts are refused."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise UserError(f"prompt_ids must be one sequence of token ids, got shape {tuple(prompt.shape)}")
    if prompt.numel() == 0:
        raise UserError("the prompt is empty: give at least one token")
    return prompt.to(device)


Prompt = Sequence[int] | torch.Tensor  # one prompt: token ids, [P] or [1, P]
Prompts = Sequence[Sequence[int]] | Sequence[torch.Tensor]  # a batch of prompts, any lengths
Generators = torch.Generator | Sequence[torch.Generator] | None  # one shared generator, or one per prompt


def is_batch(prompt_ids: Prompt | Prompts) -> bool:
    """Whether ``prompt_ids`` is a batch of prompts (a list or tuple of sequences), not one prompt."""
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        return False
    first = prompt_ids[0]
    return isinstance(first, (list, tuple)) or (isinstance(first, torch.Tensor) and first.dim() > 0)


def row_generators(generator: Generators, count: int) -> list[torch.Generator | None]:
    """The generator each of ``count`` rows draws from: the one given (shared, drawn in row order
    within a round), or one per prompt."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != count:
            raise UserError(f"{len(generator)} generators for {count} prompts: give one per prompt")
        return list(generator)
    return [cast("torch.Generator | None", generator)] * count  # not a list or tuple: one shared generator


def check_batch_size(batch_size: int | None) -> None:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise UserError(f"batch_size must be a positive integer or None, got {batch_size!r}")


def batch_prompts(model: torch.nn.Module, prompt_ids: Prompt | Prompts, batch_size: int | None,
                  response_length: int, **special: EosIds) -> tuple[bool, list[torch.Tensor]]:
    """Whether ``prompt_ids`` is a batch, and its prompts as 1-D tensors on the model's device, each
    checked (``check_ids``) for ``response_length`` more tokens; ``batch_size`` is checked too."""
    batch = is_batch(prompt_ids)
    check_batch_size(batch_size)
    device = next(model.parameters()).device
    rows = cast("Sequence[Prompt]", prompt_ids if batch else [prompt_ids])  # is_batch tells one prompt from a batch
    prompts = [prompt_tensor(p, torch.device("cpu")) for p in rows]
    for prompt in prompts:  # checked on the host, before they go to the device
        check_ids(model, prompt, prompt.numel() + response_length, **special)
    return batch, [prompt.to(device) for prompt in prompts]


def row_callback(on_step: Callable[..., None] | None, index: int, batch: bool) -> Callable[[Any], None] | None:
    """The caller's ``on_step`` as one row sees it: ``on_step(index, record)`` in a batch, else ``on_step(record)``."""
    if on_step is None or not batch:
        return on_step
    return functools.partial(on_step, index)


def input_vocabulary(model: torch.nn.Module) -> int:
    """Rows of the input embedding table of ``model``, a transformers model (``get_input_embeddings``)."""
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()
    return cast(torch.nn.Embedding, embeddings).num_embeddings


def check_ids(model: torch.nn.Module, prompt: torch.Tensor, total_length: int, **special: EosIds) -> None:
    """Refuse token ids outside the vocabulary and sequences longer than the model's context."""
    vocab = input_vocabulary(model)
    for name, token_ids in special.items():
        for token_id in eos_ids(token_ids):
            if not 0 <= token_id < vocab:
                raise UserError(f"{name} {token_id} is outside the model's vocabulary (size {vocab})")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise UserError(f"the prompt holds token ids outside the model's vocabulary (size {vocab})")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and total_length > limit:
        raise UserError(
            f"prompt ({prompt.numel()} tokens) + response budget ({total_length - prompt.numel()}) "
            f"= {total_length} tokens exceeds the model's context of {limit}"
        )


# ---------------------------------------------------------------------------------------------
# sampling


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """argmax(logits / T + Gumbel noise), in float64 (float32 on MPS); plain argmax at T = 0."""
    if temperature == 0:
        return logits.argmax(-1)
    return with_gumbel(logits, temperature, uniform(tuple(logits.shape), generator, logits.device)).argmax(-1)


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U(0, 1) float64 draws (float32 on MPS) from ``generator`` (on its own device), moved to ``device``."""
    noise_device = generator.device if generator is not None else device
    wide = wide_float(torch.device(device))
    return torch.rand(shape, generator=generator, dtype=wide, device=noise_device).to(device)


def with_gumbel(logits: torch.Tensor, temperature: float, uniform: torch.Tensor) -> torch.Tensor:
    """``logits`` in float64 (float32 on MPS) plus ``temperature`` times the Gumbel noise of the U(0, 1) draws
    ``uniform`` (as ``logits``, on its device)."""
    return logits.to(wide_float(logits.device)) + temperature * -torch.log(-torch.log(uniform))


def token_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Softmax probability of ``tokens`` [..., L] under ``logits`` [..., L, V] at the same positions."""
    return torch.softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def next_token_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """AR probability of token j under the logits of token j-1 ([..., L]); position 0 gets 1."""
    probs = torch.ones(tokens.shape, dtype=logits.dtype, device=logits.device)
    probs[..., 1:] = token_probs(logits[..., :-1, :], tokens[..., 1:])
    return probs


# ---------------------------------------------------------------------------------------------
# rows of different lengths, end to end (a ragged ``readback.decide``)


def firsts_of(sizes: list[int]) -> np.ndarray:
    """For runs of ``sizes`` elements laid end to end: the index of each element's run's first element (host)."""
    return np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)


def ragged_rows(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of ``sizes`` elements laid end to end: each element's row, its place in its row and the index of
    its row's first element ([sum sizes] each), copied to ``device`` at once."""
    firsts = firsts_of(sizes)
    rows, places, first_of = device_index(
        np.stack([np.repeat(np.arange(len(sizes)), sizes), np.arange(sum(sizes)) - firsts, firsts]), device)
    return rows, places, first_of


def side_by_side(values: torch.Tensor, sizes: list[int], rows: torch.Tensor, places: torch.Tensor,
                 fill: float) -> torch.Tensor:
    """``values`` [sum sizes] (rows end to end, :func:`ragged_rows`) as rows [len(sizes), max(sizes)], padded
    with ``fill``."""
    return values.new_full((len(sizes), max(sizes)), fill).index_put_((rows, places), values)

