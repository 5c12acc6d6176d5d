"""One readback a step: how a row program sees device values on the host without stalling the device once per row.

A row program (``engine.Engine``) that must branch on a value computed on the device (how many slots were
chosen, where an EOS was committed, the token just drawn) does not call ``.tolist()`` itself: it yields a
:class:`Readback` of the tensors it needs (``values = yield from read(a, b)``). The engine collects the
readbacks of every running row, reads them in one transfer (:func:`read_all`: one wait for the device per
round, whatever the number of rows) and sends each row its values: one flat host list per tensor, ints for
integer and boolean tensors (``0`` / ``1``), floats for floating ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch

HostValues = tuple[list, ...]  # one flat list per tensor of a Readback, in order


@dataclass(frozen=True)
class Readback:
    """Device tensors a row needs on the host before it can go on."""

    tensors: tuple[torch.Tensor, ...]


ReadStep = Generator[Readback, HostValues, HostValues]


def read(*tensors: torch.Tensor) -> ReadStep:
    """``yield from read(a, b)`` in a row program: the host values of ``a`` and ``b`` (flat lists)."""
    return (yield Readback(tensors))


def read_all(readbacks: list[Readback]) -> list[HostValues]:
    """Every readback's values, read in one transfer per device (float64, float32 on Apple's MPS: every
    token id and every float32 or bfloat16 value is exact in them)."""
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


__all__ = ["HostValues", "ReadStep", "Readback", "read", "read_all"]
