"""`refusion bench --sweep`: each decoder over a grid of its parallelism settings, a row per setting.

Contract:

- :data:`SWEEP_GRIDS` is the one table of grids: for each kind of decoder (its config class in the
  registry), the points measured beside its
  usual row, from the least parallel to the most. A point sets only the fields in
  :data:`SWEPT_FIELDS`; everything else (``--set`` of other keys, ``--preset``, the response
  length) comes from the usual row's config, so the grid sits on top of the fixed settings.
- ``--set`` of a swept field is refused (:func:`check_swept_overrides`): the grid would overwrite
  it in every sweep row, so the command would not measure what it says.
- :func:`sweep_configs` turns a grid into configs for one usual config; a point whose setting
  (:func:`setting_label`, what the decoder actually does) is the usual row's or an earlier point's
  is left out, so every row is measured once and every label is unique.

Labels: ``refusion k=4 b=16 τ=0.9/0.9`` (k, block tokens, τ_slot/τ_token), ``llada steps=64``
(a fixed schedule), ``llada τ=0.9 cache`` (Fast-dLLM threshold mode with the prefix cache; ``dual
cache`` when the usual row's ``dual_cache`` is set, which the threshold points keep).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refusion_cli.decoding.config import ConfigError, ReFusionConfig
from refusion_cli.decoding.dream import DreamConfig
from refusion_cli.decoding.llada import LLaDAConfig
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.errors import UserError


@dataclass(frozen=True)
class SlotPoint:
    """A ReFusion point: k, the block as a number of slots (capped at the response), τ_slot, τ_token."""

    slot_size: int  # k
    slots_per_block: int  # b = slots_per_block * k, at most the padded response
    slot_threshold: float  # τ_slot
    token_threshold: float  # τ_token

    def apply(self, base: ReFusionConfig) -> ReFusionConfig:
        padded = dataclasses.replace(base, slot_size=self.slot_size, block_size=None).padded_length
        return dataclasses.replace(base, slot_size=self.slot_size,
                                   block_size=min(self.slots_per_block * self.slot_size, padded),
                                   slot_threshold=self.slot_threshold, token_threshold=self.token_threshold)


@dataclass(frozen=True)
class StepsPoint:
    """A LLaDA / Dream point with a fixed schedule: at most ``tokens_per_step`` unmasked per step."""

    tokens_per_step: int

    def apply(self, base: Any) -> Any:
        block = base.block_length if isinstance(base, LLaDAConfig) else base.block_tokens  # Dream: None = one block
        per_block = -(-block // self.tokens_per_step)  # rounded up, so that steps split evenly over the blocks
        blocks = base.gen_length // block
        return dataclasses.replace(base, steps=blocks * per_block, threshold=None, use_cache=False, dual_cache=False)


@dataclass(frozen=True)
class ThresholdPoint:
    """A LLaDA / Dream point in Fast-dLLM's threshold mode (every token with p >= threshold) with the
    prefix cache (and the dual cache if the usual row has it); the number of steps then follows the
    model's confidence, not ``steps``."""

    threshold: float

    def apply(self, base: Any) -> Any:
        return dataclasses.replace(base, threshold=self.threshold, use_cache=True)


SweepPoint = SlotPoint | StepsPoint | ThresholdPoint

REFUSION_THRESHOLDS = ((0.9, 0.9), (0.8, 0.5), (0.6, 0.2))  # (τ_slot, τ_token), strict to loose
MDM_GRID: tuple[SweepPoint, ...] = (
    *(StepsPoint(tokens) for tokens in (1, 2, 4, 8)),  # steps = gen_length, /2, /4, /8
    *(ThresholdPoint(threshold) for threshold in (0.9, 0.7, 0.5)),
)

# The one table of grids, by decoder config class, so that a new decoder of an existing kind is swept with no
# entry here; a config class without a grid (AR's greedy decoding, D2F's) has one point: its usual row.
SWEEP_GRIDS: dict[type, tuple[SweepPoint, ...]] = {
    # k ∈ {4, 8, 16, 32} (32: the paper's k for GSM8K, MATH, HumanEval, MBPP) × b ∈ {k, 4k} × three τ pairs:
    # 24 points (fewer where b reaches the response)
    ReFusionConfig: tuple(SlotPoint(k, slots, slot_threshold, token_threshold)
                          for k in (4, 8, 16, 32) for slots in (1, 4)
                          for slot_threshold, token_threshold in REFUSION_THRESHOLDS),
    LLaDAConfig: MDM_GRID,  # llada, llada-fast-dllm
    DreamConfig: MDM_GRID,  # dream, dream-fast-dllm
}

SWEPT_FIELDS: dict[type, tuple[str, ...]] = {  # the fields each grid sets
    ReFusionConfig: ("slot_size", "block_size", "slot_threshold", "token_threshold"),
    LLaDAConfig: ("steps", "threshold", "use_cache"),
    DreamConfig: ("steps", "threshold", "use_cache"),
}


def grid(decoder: str) -> tuple[SweepPoint, ...]:
    """The points swept beside ``decoder``'s usual row (none: its usual row only)."""
    return SWEEP_GRIDS.get(decoder_spec(decoder).config_class, ())


def swept_fields(decoder: str) -> tuple[str, ...]:
    return SWEPT_FIELDS.get(decoder_spec(decoder).config_class, ())


def check_swept_overrides(overrides: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse ``--set`` of a field the grid sets (decoder -> {field: value}, as BenchSettings holds them)."""
    for decoder, values in overrides.items():
        swept = [key for key in values if key in swept_fields(decoder)]
        if swept:
            raise UserError(f"--sweep varies {decoder}'s {', '.join(swept)}, so --set cannot fix "
                            f"{'it' if len(swept) == 1 else 'them'}",
                            hint=f"leave {', '.join(swept)} out of --set (the grid sets "
                                 f"{', '.join(swept_fields(decoder))}), or leave --sweep out")


def setting_label(decoder: str, config: Any) -> str:
    """What the swept fields of ``config`` make the decoder do, e.g. ``k=8 b=16 τ=0.9/0.9``."""
    if isinstance(config, ReFusionConfig):
        return (f"k={config.slot_size} b={config.block_tokens} "
                f"τ={config.slot_threshold:g}/{config.token_threshold:g}")
    if isinstance(config, (LLaDAConfig, DreamConfig)):
        mode = f"steps={config.steps}" if config.threshold is None else f"τ={config.threshold:g}"
        return mode + (" dual cache" if config.dual_cache else " cache" if config.use_cache else "")
    return "greedy"


def sweep_configs(decoder: str, base: Any) -> list[Any]:
    """The config of each grid point on ``base`` (the usual row's config), in grid order, without the
    points whose setting (:func:`setting_label`) is the usual row's or an earlier point's."""
    seen = {setting_label(decoder, base)}
    points = []
    for point in grid(decoder):
        try:
            config = point.apply(base)
        except ConfigError as exc:
            raise UserError(f"--sweep point {point} does not fit the {decoder} settings: {exc}") from None
        setting = setting_label(decoder, config)
        if setting not in seen:
            seen.add(setting)
            points.append(config)
    return points
