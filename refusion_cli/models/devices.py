"""``--device`` and ``--dtype``: the torch device and dtype a model runs on, checked where the value
enters (a misspelt name, or a device this machine lacks, is a UserError)."""

from __future__ import annotations

import gc

import torch

from refusion_cli.errors import UserError


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(device: str | torch.device | None) -> torch.device:
    """``--device``: a torch device this machine has (None: CUDA when available, else the CPU).

    A misspelt name, or a CUDA/MPS device this machine does not have, is a UserError.
    """
    if device is None or device == "":
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device '{device}'", hint="use cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device '{device}' asked for, but this torch has no usable CUDA device",
                            hint="use --device cpu, or install a CUDA build of torch")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UserError(f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError(f"device '{device}' asked for, but MPS is not available here", hint="use --device cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device '{device}'", hint="use cpu, cuda, cuda:N or mps")
    return parsed


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU that computes it natively (compute capability 8.0 or later), else float32."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return torch.bfloat16
    return torch.float32


def parse_dtype(name: str) -> torch.dtype:
    """``--dtype``: float32, bfloat16, float16, float64 (or fp32, bf16, fp16); anything else is a UserError."""
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}
    if name not in table:
        raise UserError(f"unknown dtype '{name}'; choose one of {', '.join(table)}")
    return table[name]


def free_device_memory(device: torch.device | str) -> None:
    """Give the memory of models no longer referenced back (the next model loads into it)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
