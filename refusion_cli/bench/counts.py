"""What decodes cost besides the model's arithmetic, counted rather than timed: host syncs per engine step,
attention calls per layer per model call, positions the model computed and K/V bytes the cache code copied.

:func:`counting` installs the counters around a block of decodes of one model and yields the
:class:`DecodeCounts` they fill. How each is counted:

- model calls and positions: a forward pre-hook on the model; positions are the ``input_ids`` elements of
  every call (a padded call counts its padding);
- engine steps: calls of ``Engine.step`` (``refusion_cli.decoding.engine``, as this process imports it),
  the method wrapped for the block; None where the library has no engine. Host syncs per step are those made
  inside the steps (the engine's own and its rows'), not the checks of a prompt before it is submitted;
- host syncs (:class:`CostMode`, a ``TorchFunctionMode`` that sees every torch call): ``item``, ``tolist``,
  ``bool()`` / ``int()`` / ``float()`` / ``index()`` of a tensor, ``nonzero`` and indexing with a boolean
  tensor, each a point where a GPU run waits for the device (on a CPU they cost nothing, which is why they
  are counted rather than timed); device syncs apart: calls of ``torch.cuda.synchronize`` and of a CUDA
  event's or stream's ``synchronize``;
- attention calls: ``torch.nn.functional.scaled_dot_product_attention`` (seen by the mode) and flex
  attention (``torch.nn.attention.flex_attention.flex_attention`` and transformers'
  ``compile_friendly_flex_attention``, wrapped for the block); per layer per model call. Attention that
  runs neither (eager, a kernel of a model's own) is not seen: :meth:`DecodeCounts.attention_label` then
  names the model's attention implementation instead of a 0;
- tensor ops per step: the ATen ops (``TorchDispatchMode``; views apart) that ``Engine.step`` ran outside the
  model's calls: the decoders' choices, the feeds and masks built for the next call, the readbacks. On a GPU
  each is a kernel launch or a copy (a tensor made from host values, ``lift_fresh``, counts as its copy to the
  device), so this says how the launches of a step grow with its rows; host work without torch (numpy) is not
  an op;
- K/V bytes copied: bytes written into tensors shaped like a layer's K/V ([rows, kv heads, columns, head
  dim]) by ``cat`` (not along the head dimension, where rotary embedding joins halves of a head),
  ``gather``, ``index_select``, ``pad``, item assignment, ``index_put`` and ``copy_``, less the bytes of the
  K/V the model computed for the positions it was fed (which any cache writes once): what is left is K/V
  moved or rewritten that was computed before. A model whose query heads equal its K/V heads has
  queries of that shape too; their writes count alike.

This module imports torch alone: ``tools/engine_counts.py`` loads it by its path into a process that
imports the library of an older revision, which has no such module. The wrappers are the process's
while the block runs: count in a process that decodes nothing else meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
WRITES = {"cat", "gather", "index_select", "pad", "__setitem__", "index_put_", "index_put", "copy_"}
IN_PLACE = {"__setitem__", "index_put_", "copy_"}  # written into their first argument, not their result
SDPA = "scaled_dot_product_attention"
FLEX = [("torch.nn.attention.flex_attention", "flex_attention"),
        ("transformers.integrations.flex_attention", "compile_friendly_flex_attention")]


@dataclass
class DecodeCounts:
    """What the decodes of one :func:`counting` block did besides the model's arithmetic."""

    layers: int  # the model's attention layers
    kv_bytes_per_position: int  # K and V of one position in every layer, in the model's dtype
    attention: str  # the model's attention implementation (its config's), named where no call was seen
    model_calls: int = 0
    positions: int = 0  # input_ids elements of every model call, padding included
    engine_steps: int | None = 0  # Engine.step calls (None: the library has no engine)
    host_syncs: int = 0
    step_syncs: int = 0  # the host syncs made inside Engine.step
    step_ops: int = 0  # tensor ops Engine.step ran outside the model's calls (views apart)
    device_syncs: int = 0  # torch.cuda.synchronize, CUDA events' and streams' synchronize
    sdpa_calls: int = 0
    flex_calls: int = 0
    kv_written: int = 0  # bytes written into K/V-shaped tensors, the fresh K/V included

    @property
    def kv_copied(self) -> int:
        """K/V bytes written beyond the K/V of the positions fed: moved or rewritten, computed before."""
        return max(0, self.kv_written - self.positions * self.kv_bytes_per_position)

    def syncs_per_step(self) -> float | None:
        return self.step_syncs / self.engine_steps if self.engine_steps else None

    def ops_per_step(self) -> float | None:
        return self.step_ops / self.engine_steps if self.engine_steps else None

    def syncs_per_call(self) -> float | None:
        return self.host_syncs / self.model_calls if self.model_calls else None

    def attention_per_layer(self) -> float | None:
        """Attention calls per layer per model call; None when none was seen (see :meth:`attention_label`)."""
        calls = self.sdpa_calls + self.flex_calls
        return calls / (self.layers * self.model_calls) if calls and self.model_calls and self.layers else None

    def attention_label(self, digits: int = 2) -> str:
        """:meth:`attention_per_layer`, or the attention the model runs where no call of it was seen."""
        per_layer = self.attention_per_layer()
        return f"{per_layer:.{digits}f}" if per_layer is not None else f"{self.attention} (not counted)"

    def per_token(self, tokens: int) -> tuple[float | None, float | None]:
        """Positions and K/V bytes copied per generated token."""
        if not tokens:
            return None, None
        return self.positions / tokens, self.kv_copied / tokens

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kv_copied": self.kv_copied}


class CostMode(TorchFunctionMode):
    """Counts host syncs, scaled-dot-product attention calls and K/V-shaped writes into ``counts``."""

    def __init__(self, counts: DecodeCounts, kv_heads: int, head_dim: int, steps: Tally | None = None):
        super().__init__()
        self.counts = counts
        self.steps = steps  # the engine's steps, to tell the syncs inside them
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in SYNCS or (name == "__getitem__" and _bool_index(args[1])):
            self.counts.host_syncs += 1
            self.counts.step_syncs += bool(self.steps is not None and self.steps.depth)
        elif name == SDPA:
            self.counts.sdpa_calls += 1
        elif name in WRITES:
            self.counts.kv_written += self.kv_bytes_written(name, args, kwargs, out)
        return out

    def kv_bytes_written(self, name: str, args: tuple, kwargs: dict, out: Any) -> int:
        target = args[0] if name in IN_PLACE else out
        if not self.kv_shaped(target) or (name == "cat" and _cat_dim(args, kwargs, target) == 3):
            return 0
        source = out
        if name == "__setitem__":
            source = args[2]
        elif name == "copy_":
            source = args[1]
        elif name in {"index_put_", "index_put"}:
            source = args[2] if len(args) > 2 else kwargs.get("values")
        return source.numel() * source.element_size() if isinstance(source, torch.Tensor) else 0

    def kv_shaped(self, tensor: Any) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[1] == self.kv_heads
                and tensor.shape[3] == self.head_dim)


class OpsMode(TorchDispatchMode):
    """Counts the ATen ops run inside the engine's steps (``steps``) and outside the model's calls (``model``)
    into ``counts.step_ops``; views (an op that only reshapes) apart."""

    def __init__(self, counts: DecodeCounts, steps: Tally, model: Tally):
        super().__init__()
        self.counts, self.steps, self.model = counts, steps, model

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.steps.depth and not self.model.depth and not func.is_view:
            self.counts.step_ops += 1
        return func(*args, **(kwargs or {}))


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


def _cat_dim(args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return dim % out.dim() if isinstance(dim, int) else -1


def model_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """The model's attention layers, K/V heads and head dimension, from its config."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "n_kv_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", None)
                                                     or getattr(config, "d_model")) // heads
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layers")
    return int(layers), int(kv_heads), int(head_dim)


@contextlib.contextmanager
def counting(model: torch.nn.Module) -> Iterator[DecodeCounts]:
    """Count what the decodes of ``model`` in the block do (the module docstring says how)."""
    layers, kv_heads, head_dim = model_shape(model)
    element = next(model.parameters()).element_size()
    counts = DecodeCounts(layers, 2 * layers * kv_heads * head_dim * element,
                          str(getattr(model.config, "_attn_implementation", None) or "unknown"))

    def fed(module: torch.nn.Module, call_args: tuple, call_kwargs: dict) -> None:
        ids = call_kwargs.get("input_ids", call_args[0] if call_args else None)
        counts.model_calls += 1
        counts.positions += ids.numel() if isinstance(ids, torch.Tensor) else 0
        calling.depth += 1

    def returned(*_: Any) -> None:
        calling.depth -= 1

    calling = Tally(counts, "model_calls")  # its depth only: inside a model call
    with contextlib.ExitStack() as stack:
        stack.callback(model.register_forward_pre_hook(fed, with_kwargs=True).remove)
        stack.callback(model.register_forward_hook(returned, always_call=True).remove)
        engine = _engine_class()
        steps = None
        if engine is None:
            counts.engine_steps = None
        else:
            steps = Tally(counts, "engine_steps")
            stack.enter_context(steps.wrapping(engine, "step"))
        flex = Tally(counts, "flex_calls")  # one tally: transformers' flex calls torch's, and counts once
        for module, name in FLEX:
            if module in sys.modules:
                stack.enter_context(flex.wrapping(sys.modules[module], name))
        if torch.cuda.is_available():
            device_syncs = Tally(counts, "device_syncs")
            for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                                (torch.cuda.Stream, "synchronize")):
                stack.enter_context(device_syncs.wrapping(owner, name))
        stack.enter_context(CostMode(counts, kv_heads, head_dim, steps))
        if steps is not None:
            stack.enter_context(OpsMode(counts, steps, calling))
        yield counts


def _engine_class() -> type | None:
    try:
        from refusion_cli.decoding.engine import Engine
    except ImportError:  # a revision before the engine
        return None
    return Engine


@dataclass
class Tally:
    """Counts calls of wrapped functions into one field of ``counts``; a call made inside a counted one (a
    wrapper calling the function it wraps) is not counted again."""

    counts: DecodeCounts
    field: str
    depth: int = 0

    @contextlib.contextmanager
    def wrapping(self, owner: Any, name: str) -> Iterator[None]:
        """``owner.name`` counted while the block runs (nothing when ``owner`` has no such attribute)."""
        original = getattr(owner, name, None)
        if original is None:
            yield
            return
        owned = name in vars(owner)  # else inherited: deleted again afterwards

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.depth:
                setattr(self.counts, self.field, getattr(self.counts, self.field) + 1)
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        setattr(owner, name, counted)
        try:
            yield
        finally:
            if owned:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


__all__ = ["CostMode", "DecodeCounts", "OpsMode", "Tally", "counting", "model_shape"]
