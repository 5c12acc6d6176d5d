"""The learning-rate schedule: linear warmup, then cosine decay, and following it after a resume."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def cosine_with_warmup(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR factor for optimizer step s (0-based): linear warmup to 1, then cosine decay towards 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def follow_schedule(scheduler: Any) -> None:
    """Set the optimizer's learning rate from the schedule at the scheduler's restored step.

    A checkpoint restores the learning rate the old run would have used next; when --steps was
    raised on resume, the schedule (built from the new --steps) says otherwise, and it decides.
    Unchanged --steps give the same value, so an exact resume stays exact.
    """
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate wraps it
    rates = [base * factor(inner.last_epoch) for base, factor in zip(inner.base_lrs, inner.lr_lambdas)]
    for group, rate in zip(inner.optimizer.param_groups, rates):
        group["lr"] = rate
    inner._last_lr = rates
