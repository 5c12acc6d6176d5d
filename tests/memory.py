"""Model calls that run out of memory on demand, as a GPU's would: for the tests of the engine's requeue."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def out_of_memory_above(monkeypatch: pytest.MonkeyPatch, calls_class: Any, rows: int,
                        times: int | None = None) -> list[int]:
    """Make every call of ``calls_class`` (``cache.CausalRunner``, ``mdm.CanvasRunner``) of more than ``rows`` rows
    raise CUDA's out-of-memory error (only the first ``times`` such calls, if given); returns the list that receives
    the rows of each call that did."""
    forward = calls_class.forward
    failed: list[int] = []

    def small_memory(self: Any, feeds: dict[int, Any]) -> dict[int, Any]:
        if len(feeds) > rows and (times is None or len(failed) < times):
            failed.append(len(feeds))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, feeds)

    monkeypatch.setattr(calls_class, "forward", small_memory)
    return failed
