"""One readback a step: how a row program sees device values on the host without stalling the device once per row.

A row program (``engine.Engine``) that must branch on a value computed on the device (how many slots were
chosen, where an EOS was committed, the token just drawn) does not call ``.tolist()`` itself: it yields a
:class:`Readback` of the tensors it needs (``values = yield from read(a, b)``). The engine collects the
readbacks of every running row, reads them in one transfer (:func:`read_all`: one wait for the device per
round, whatever the number of rows) and sends each row its values: one flat host list per tensor, ints for
integer and boolean tensors (``0`` / ``1``), floats for floating ones.

A decision that is the same function for every row (LLaDA's unmasking) is yielded as :class:`Batched`
(``values = yield from decide(key, function, *inputs)``): the engine stacks the inputs of every row waiting on
the same ``key`` (and input shapes), calls ``function`` once on them and reads each row its row of the outputs
with the round's other values, so a step's launches for it do not grow with the rows. Rows whose inputs differ
in their first dimension (ReFusion's slots) are joined end to end instead (``ragged``): the function is told
each row's size and returns outputs of the same sizes.

Host values go the other way in one copy too (:func:`device_index`, :func:`to_device`): a row may hand a
batched decision numpy inputs, which are joined on the host and copied once.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Hashable
from typing import Any, Generator, Sequence

import numpy as np
import torch

HostValues = tuple[list, ...]  # one flat list per tensor of a Readback, in order


@dataclass(frozen=True)
class Readback:
    """Device tensors a row needs on the host before it can go on."""

    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Batched:
    """A row's inputs to a function computed for every row with the same ``key`` at once: ``function`` takes
    each input stacked over those rows ([N, ...]) and returns tensors [N, ...]; the row is sent the host values
    of its row of each. With ``ragged`` the inputs (each [n, ...], n the row's own) are joined end to end
    ([sum n, ...]), ``function(sizes, *inputs)`` is told the rows' sizes (a host list) and returns outputs
    [sum n, ...]. Inputs are device tensors or host numpy arrays (the first a tensor: its device is theirs)."""

    key: Hashable
    function: Callable[..., tuple[torch.Tensor, ...]]
    inputs: tuple[torch.Tensor | np.ndarray, ...]
    ragged: bool = False


ReadStep = Generator["Readback | Batched", HostValues, HostValues]


def read(*tensors: torch.Tensor) -> ReadStep:
    """``yield from read(a, b)`` in a row program: the host values of ``a`` and ``b`` (flat lists)."""
    return (yield Readback(tensors))


def decide(key: Hashable, function: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor | np.ndarray,
           ragged: bool = False) -> ReadStep:
    """``yield from decide(key, function, a, b)`` in a row program: the host values of this row's outputs of
    ``function`` on every waiting row's stacked (``ragged``: joined) inputs (see :class:`Batched`)."""
    return (yield Batched(key, function, inputs, ragged))


def device_index(values: Sequence[Any] | np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` (ints, or tuples of ints) as a long tensor on ``device``."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the host, on ``device``: copied without waiting for the device (from pinned memory on
    CUDA, where a plain copy would wait for the queue)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def joined(pieces: Sequence[torch.Tensor | np.ndarray], device: torch.device) -> torch.Tensor:
    """``pieces`` end to end on ``device``, in order: device tensors as they are (a view, not a copy, where they
    already lie end to end in one tensor: a call's logits, row after row), host numpy arrays copied in one
    transfer whatever their number."""
    host = [piece for piece in pieces if isinstance(piece, np.ndarray)]
    if not host:
        tensors = [piece for piece in pieces if isinstance(piece, torch.Tensor)]
        view = _end_to_end(tensors)
        return torch.cat(tensors) if view is None else view
    copied = to_device(torch.tensor(np.concatenate(host)), device)
    if len(host) == len(pieces):
        return copied
    parts, start = [], 0
    for piece in pieces:
        if isinstance(piece, np.ndarray):
            parts.append(copied[start: start + len(piece)])
            start += len(piece)
        else:
            parts.append(piece)
    return torch.cat(parts)


def _end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` as one view when each is contiguous and starts where the one before ends (None otherwise)."""
    first = tensors[0]
    address = first.data_ptr()
    for tensor in tensors:
        if (not len(tensor) or not tensor.is_contiguous() or tensor.dtype != first.dtype
                or tensor.shape[1:] != first.shape[1:] or tensor.data_ptr() != address
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        address += tensor.numel() * tensor.element_size()
    return first.as_strided((sum(len(tensor) for tensor in tensors), *first.shape[1:]), first.stride(),
                            first.storage_offset())


def _shape(value: torch.Tensor | np.ndarray, ragged: bool) -> Hashable:
    """What rows must share to be joined: the shape (past the first dimension when ``ragged``) and dtype."""
    shape = tuple(value.shape[1:] if ragged else value.shape)
    return (shape, str(value.dtype), value.device if isinstance(value, torch.Tensor) else "host")


def _address(value: torch.Tensor | np.ndarray) -> int:
    return value.data_ptr() if isinstance(value, torch.Tensor) else 0


def computed(waits: list[Readback | Batched]) -> list[Readback]:
    """Each :class:`Batched` made the readback of its row's outputs: one call of its function for every group of
    them with one key and input shapes; a :class:`Readback` as it is."""
    groups: dict[Hashable, list[Batched]] = {}
    for wait in waits:
        if isinstance(wait, Batched):
            shapes = tuple(_shape(value, wait.ragged) for value in wait.inputs)
            groups.setdefault((wait.key, wait.ragged, shapes), []).append(wait)
    ready: dict[int, Readback] = {}  # by id of the Batched
    for members in groups.values():
        # in the order their first inputs lie in memory: rows' slices of one call's logits are then one view
        members.sort(key=lambda member: _address(member.inputs[0]))
        first = members[0]
        device = torch.as_tensor(first.inputs[0]).device
        inputs = [joined(column if first.ragged else [value[None] for value in column], device)
                  for column in zip(*(m.inputs for m in members))]
        if not first.ragged:
            outputs = first.function(*inputs)
            for row, member in enumerate(members):
                ready[id(member)] = Readback(tuple(output[row] for output in outputs))
            continue
        sizes = [len(member.inputs[0]) for member in members]
        outputs = first.function(sizes, *inputs)
        start = 0
        for size, member in zip(sizes, members):
            ready[id(member)] = Readback(tuple(output[start: start + size] for output in outputs))
            start += size
    return [ready[id(wait)] if isinstance(wait, Batched) else wait for wait in waits]


def read_all(waits: list[Readback | Batched]) -> list[HostValues]:
    """Every wait's values, read in one transfer per device (float64, float32 on Apple's MPS: every
    token id and every float32 or bfloat16 value is exact in them)."""
    readbacks = computed(waits)
    tensors = [tensor for readback in readbacks for tensor in readback.tensors]
    values: list[list] = [[] for _ in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    for device, on_device in by_device.items():
        wide = torch.float32 if device.type == "mps" else torch.float64
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index in on_device:
            by_dtype.setdefault(tensors[index].dtype, []).append(index)
        indices = [index for same in by_dtype.values() for index in same]  # the order of ``packed``
        # a few ops whatever the number of tensors: one cat and one conversion per dtype, one cat of those
        parts = [torch.cat([tensors[i].detach().reshape(-1) for i in same]).to(wide) for same in by_dtype.values()]
        packed = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the one wait
        offset = 0
        for i in indices:
            count = tensors[i].numel()
            chunk = packed[offset: offset + count]
            offset += count
            values[i] = chunk if tensors[i].is_floating_point() else [int(value) for value in chunk]
    out, start = [], 0
    for readback in readbacks:
        out.append(tuple(values[start: start + len(readback.tensors)]))
        start += len(readback.tensors)
    return out


__all__ = ["Batched", "HostValues", "ReadStep", "Readback", "decide", "device_index", "joined", "read", "read_all", "to_device"]
