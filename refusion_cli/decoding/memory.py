"""How much memory a decode takes, and the largest batch that fits a budget (``--batch-size auto``).

The model counts what the tensors of a decode hold at once, from the decoders' code:

- the weights, once;
- per row, at its largest model call (:class:`RowShape`, one function per decoder below, named by its
  registry entry):
  - K/V: ``2 x layers x K/V heads x head dim`` words per position whose K/V the row holds at that
    call (its cache, and the call's own when it keeps them; a call without a cache holds one
    layer's at a time, which the activations count);
  - activations of one layer at a time, per fed position: the residual stream and its norm, the
    attention's projections and the MLP's gate, up and product (``4 x hidden + 3 x intermediate``);
    and the additive mask of a padded batched call (fed x attended positions);
  - logits and the sampler's copies of them: the positions whose logits one call computes for the
    row (a LLaDA block, Dream's chunk of masks, ReFusion's planned block) times the vocabulary, times
    the bytes per word the sampler holds at its peak (its dtype casts, softmax, sort, noise).

The peak is per row because rows share nothing but the weights: a batch of B holds B rows.
``tools/logits_memory.py`` checks the row model against the peak resident set measured on the
checkpoints' stand-ins. What no model counts (allocator slack, the libraries' workspaces) is held back
from the budget: :data:`RESERVE_SHARE` of it, at least :data:`RESERVE_MIN` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.mdm import LOGITS_CHUNK, output_head

RESERVE_SHARE = 0.05  # of the budget, held back for what the model does not count
RESERVE_MIN = 64 * 2**20  # bytes
D2F_DEPTH = 2  # blocks D2F's pipeline decodes at once in the model (it can run deeper; a halved batch catches that)


@dataclass(frozen=True)
class RowShape:
    """What one row of a decoder holds at its largest model call (positions, and bytes per logit word)."""

    kv: int  # positions whose K/V (every layer) the row holds during that call
    fed: int  # positions the call feeds
    attended: int  # positions each fed one attends to (its cache and the fed ones)
    read: int  # positions whose logits the call computes for the row
    sampler: int  # bytes the sampler holds per logit word read at its peak (the logits and their copies)


@dataclass(frozen=True)
class ModelSize:
    """The dimensions of a loaded model that its memory depends on."""

    weights: int  # bytes of every parameter and buffer
    layers: int
    kv_width: int  # K/V heads x head dim
    hidden: int
    intermediate: int
    vocabulary: int
    word: int  # bytes per number of the model's dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelSize:
        config: Any = model.config  # transformers' config: its fields are dynamic
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        tensors = [*model.parameters(), *model.buffers()]
        head = output_head(model)
        return cls(weights=sum(t.numel() * t.element_size() for t in tensors), layers=config.num_hidden_layers,
                   kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
                   hidden=config.hidden_size, intermediate=config.intermediate_size,
                   vocabulary=int(getattr(head, "weight").shape[0]) if head is not None else config.vocab_size,
                   word=next(model.parameters()).element_size())


def row_bytes(shape: RowShape, size: ModelSize) -> int:
    """Bytes one row holds at its largest call (see the module docstring)."""
    kv = 2 * size.layers * size.kv_width * shape.kv * size.word
    activations = shape.fed * (4 * size.hidden + 3 * size.intermediate) * size.word
    mask = shape.fed * shape.attended * size.word
    return kv + activations + mask + shape.read * size.vocabulary * shape.sampler


# ------------------------------------------------------------------------------------------------
# each decoder's row: (config, prompt length, bytes per word of the model) -> RowShape

RowMemory = Callable[[Any, int, int], RowShape]


def ar_memory(config: Any, prompt: int, word: int) -> RowShape:
    # the prompt's call is the largest; it keeps its K/V, and the cache grows to the whole response
    total = prompt + config.gen_length
    return RowShape(kv=total, fed=prompt, attended=prompt, read=1, sampler=2 * max(word, 4))


def refusion_memory(config: Any, prompt: int, word: int) -> RowShape:
    # the largest logits: the plan of a whole block of masked slots, cast to float32 and softmaxed
    # (the model's logits are let go once cast: two float32 copies at once)
    total = prompt + config.padded_length
    return RowShape(kv=total, fed=max(prompt, config.block_tokens), attended=total, read=config.block_tokens,
                    sampler=2 * max(word, 4))


def llada_memory(config: Any, prompt: int, word: int) -> RowShape:
    # the block's logits, a copy with the mask made impossible, and their float64 softmax; classifier-free
    # guidance feeds a second (unconditioned) canvas in the same call
    total = prompt + config.gen_length
    streams = 2 if config.cfg_scale > 0 else 1
    return RowShape(kv=streams * total if config.use_cache else 0, fed=streams * total, attended=total,
                    read=streams * config.block_length, sampler=2 * word + 8)


def dream_sampler_bytes(config: Any, word: int) -> int:
    """Bytes per logit word of Dream's ``predict_tokens`` at its peak (D2F's sampler is the same)."""
    greedy = word * 4  # the logits, the row's copy of its read positions, their softmax and its masked copy
    if config.temperature == 0 and config.top_p in (None, 1) and config.top_k is None:
        return greedy
    # sampling: the scaled logits, top-p's sort (values and int64 order), running mass and masks, the
    # filtered logits, then float32 weights and the exponential noise multinomial draws over them
    return greedy + 3 * word + 8 + 2 + 4 + 4


def dream_memory(config: Any, prompt: int, word: int) -> RowShape:
    # the block's masks are read (without a cache: the whole response at the first call), LOGITS_CHUNK at a time
    total = prompt + config.gen_length
    return RowShape(kv=total if config.use_cache else 0, fed=total, attended=total,
                    read=min(config.block_tokens, LOGITS_CHUNK), sampler=dream_sampler_bytes(config, word))


def d2f_memory(config: Any, prompt: int, word: int) -> RowShape:
    # the first call feeds the prompt and the first block; D2F_DEPTH blocks' masks are read at once
    total = prompt + config.gen_length
    return RowShape(kv=total, fed=prompt + config.block_size, attended=total,
                    read=min(config.gen_length, D2F_DEPTH * config.block_size),
                    sampler=dream_sampler_bytes(config, word))


# ------------------------------------------------------------------------------------------------
# the batch that fits


@dataclass(frozen=True)
class BatchChoice:
    """``--batch-size auto``'s choice and the numbers behind it."""

    size: int
    budget: int  # bytes the weights and the rows may take
    source: str  # where the budget comes from ("--max-memory", "free GPU memory", "available RAM")
    weights: int
    row: int  # bytes of the largest row
    requests: int
    fits: int  # rows the budget holds (the batch is at most ``requests`` of them)

    def describe(self) -> str:
        """One line: the batch and why."""
        return (f"batch size auto: {self.size} ({_mib(self.budget)} {self.source}, weights {_mib(self.weights)}, "
                f"reserve {_mib(reserve(self.budget))}, {_mib(self.row)} a row at the longest prompt"
                f"{', capped at the ' + str(self.requests) + ' requests' if self.fits > self.requests else ''})")


def reserve(budget: int) -> int:
    return max(RESERVE_MIN, int(RESERVE_SHARE * budget))


def fitting_batch(budget: int, weights: int, row: int, requests: int, source: str) -> BatchChoice:
    """The largest batch whose weights, rows and reserve fit ``budget`` (at least 1, at most ``requests``)."""
    rows = int((budget - weights - reserve(budget)) // max(row, 1))
    return BatchChoice(max(1, min(rows, requests)), budget, source, weights, row, requests, rows)


def memory_budget(device: torch.device, max_memory: int | None, weights: int) -> tuple[int, str]:
    """Bytes the weights and the rows may take on ``device``, and where that figure comes from (on a CPU the
    tokenizer and libraries of the process are outside it).

    ``max_memory`` (``--max-memory``) when given, never more than a GPU has: its free memory now
    (the weights already loaded) plus the weights. Without it: a GPU's free memory plus the weights,
    or on a CPU the RAM Linux reports available plus the weights."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + weights
        if max_memory is not None and max_memory <= free:
            return max_memory, "--max-memory"
        return free, "free GPU memory and the weights" + (" (less than --max-memory)" if max_memory else "")
    if max_memory is not None:
        return max_memory, "--max-memory"
    return available_ram() + weights, "available RAM and the weights"


def available_ram() -> int:
    """Linux's MemAvailable in bytes (what can be allocated without swapping)."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that did not fit (a GPU's, or the CPU allocator's)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_memory(text: str | int) -> int:
    """A memory size in bytes from ``20GiB``, ``500MB``, ``1.5G`` or a number of bytes (ConfigError otherwise)."""
    value = str(text).strip().lower().replace(" ", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    try:
        size = float(number) * UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(f"cannot read {text!r} as a memory size: give e.g. 20GiB, 500MB or 1.5G") from None
    if not 0 < size < 2**62:
        raise ConfigError(f"a memory size must be positive, got {text!r}")
    return int(size)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"
