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
with the round's other values, so a step's launches for it do not grow with the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Hashable
from typing import Generator

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
    of its row of each."""

    key: Hashable
    function: Callable[..., tuple[torch.Tensor, ...]]
    inputs: tuple[torch.Tensor, ...]


ReadStep = Generator["Readback | Batched", HostValues, HostValues]


def read(*tensors: torch.Tensor) -> ReadStep:
    """``yield from read(a, b)`` in a row program: the host values of ``a`` and ``b`` (flat lists)."""
    return (yield Readback(tensors))


def decide(key: Hashable, function: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor) -> ReadStep:
    """``yield from decide(key, function, a, b)`` in a row program: the host values of this row's outputs of
    ``function`` on every waiting row's stacked inputs (see :class:`Batched`)."""
    return (yield Batched(key, function, inputs))


def computed(waits: list[Readback | Batched]) -> list[Readback]:
    """Each :class:`Batched` made the readback of its row's outputs: one call of its function for every group of
    them with one key and input shapes; a :class:`Readback` as it is."""
    groups: dict[Hashable, list[Batched]] = {}
    for wait in waits:
        if isinstance(wait, Batched):
            shapes = tuple((value.shape, value.dtype, value.device) for value in wait.inputs)
            groups.setdefault((wait.key, shapes), []).append(wait)
    ready: dict[int, Readback] = {}  # by id of the Batched
    for members in groups.values():
        outputs = members[0].function(*(torch.stack(column) for column in zip(*(m.inputs for m in members))))
        for row, member in enumerate(members):
            ready[id(member)] = Readback(tuple(output[row] for output in outputs))
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


__all__ = ["Batched", "HostValues", "ReadStep", "Readback", "decide", "read", "read_all"]
