"""Named recipes for ``refusion train --recipe``: a set of :class:`TrainConfig` values under one name.

``reference`` is the public ReFusion train.py's fine-tuning recipe. A recipe only fills in the
options the command line leaves out: an option given explicitly wins. ``--steps`` (or ``--epochs``)
given explicitly replaces the recipe's epochs as a whole, since the two say the same thing.
"""

from __future__ import annotations

from typing import Any

from refusion_cli.errors import UserError

RECIPES: dict[str, dict[str, object]] = {
    "reference": {
        "lr": 2e-5,  # peak learning rate, cosine decay to 0
        "warmup_ratio": 0.0,  # no warmup
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "mixed_precision": "bf16",
        "epochs": 4,  # --steps becomes ceil(4 × examples / batch_size)
        "max_length": 4096,
        "gradient_checkpointing": True,
    },
}
LENGTH_OF_RUN = ("steps", "epochs")  # either one, given explicitly, sets the length; the recipe's epochs go


def recipe_values(name: str) -> dict[str, object]:
    """The TrainConfig values of recipe ``name``; an unknown name is a UserError."""
    if name not in RECIPES:
        raise UserError(f"unknown --recipe '{name}'; choose one of: {', '.join(RECIPES)}")
    return dict(RECIPES[name])


def apply_recipe(name: str | None, options: dict[str, Any], explicit: set[str]) -> dict[str, Any]:
    """``options`` (TrainConfig keyword arguments) with recipe ``name`` filling every one not in ``explicit``."""
    if name is None:
        return dict(options)
    values = recipe_values(name)
    if explicit & set(LENGTH_OF_RUN):
        values.pop("epochs", None)
    return {**options, **{key: value for key, value in values.items() if key not in explicit}}
