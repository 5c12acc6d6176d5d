"""``model_args`` of the adapters: the keys an adapter takes besides the decoder's config fields, read and
checked where they enter. An unknown key is an error that lists the decoder's and the adapter's options;
values arrive as lm-eval's strings (``true``, ``8``) or as Python values."""

from __future__ import annotations

import dataclasses
from typing import Any

from refusion_cli.decoding.config import ConfigError, config_fields
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.decoding.spec import PRESET_DECODER, DecoderChoice, preset_config
from refusion_cli.decoding.variants import FLAGS

# model_args keys that are not decoder settings
ADAPTER_OPTIONS: dict[str, str] = {
    "pretrained": "checkpoint: embedded name, local directory or hub id (default: the decoder's embedded model)",
    "device": "torch device (default: cuda if available, else cpu; the process's device under accelerate)",
    "dtype": "float32, bfloat16, float16 or float64 (default: bf16 on GPUs that have it, else float32)",
    "trust_remote_code": "run the modelling code a checkpoint ships (not needed for LLaDA / Dream)",
    "preset": f"the decoder's preset to start from (ReFusion's: {', '.join(decoder_spec(PRESET_DECODER).presets)})",
    "seed": "seed of the per-request generator (Gumbel noise, random remasking)",
    "enable_thinking": "passed to the chat template (Qwen3 templates read it)",
    "protocol": "whose answer handling: lm-eval (default, lm-eval's hf model) or paper (the paper's harness: the "
                "response ends at the tokenizer's EOS only, special tokens go after the stop strings)",
    "batch_size": "requests decoded together (default 1, the paper's setting; every answer is the one of batch 1 "
                  "up to float rounding), or auto: the largest batch the memory model fits (decoding/memory.py)",
    "max_batch_size": "the largest batch batch_size=auto may choose",
    "max_memory": "with batch_size=auto: what the weights and the rows may take, e.g. 20GiB (default: a GPU's free "
                  "memory, or the RAM available)",
    **{flag: f"refusion only: decode with {flag}=True, one of this toolkit's decoding variants (default false)"
       for flag in FLAGS},
}


def as_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes"}:
        return True
    if text in {"0", "false", "no"}:
        return False
    raise ConfigError(f"{name}: cannot read {value!r} as a boolean")


def lm_eval_default_device() -> str | None:
    """The device lm-eval passes to a model when ``--device`` is not given (its config's default)."""
    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:  # lm-eval releases without that config pass None
        return None
    for config_field in dataclasses.fields(EvaluatorConfig):
        if config_field.name == "device":  # a string, or None
            return config_field.default if isinstance(config_field.default, str) else None
    return None


def check_model_args(decoder: str, keys: set[str]) -> None:
    """An unknown ``model_args`` key is an error that lists the decoder's and the adapter's options."""
    fields = config_fields(decoder_spec(decoder).config_class)
    unknown = sorted(keys - set(fields) - set(ADAPTER_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown model_args key(s) for the {decoder} adapter: {', '.join(unknown)}; "
            f"decoder options: {', '.join(fields)}; adapter options: {', '.join(ADAPTER_OPTIONS)}"
        )


def decoder_choice(decoder: str, preset: str | None, options: dict[str, Any], model: str | None = None) -> DecoderChoice:
    """The decoder options of ``model_args``: a preset of the decoder (ReFusion's: the paper's, or the
    toolkit's such as ``synthetic_tiny``), else ``model``'s own (as every command), then ``options``."""
    if preset is not None:
        preset_config(preset, decoder)  # an unknown name is an error, not the defaults
    return DecoderChoice(decoder, model, preset, options)


def decoder_config(decoder: str, preset: str | None, options: dict[str, Any]) -> Any:
    """The decoder's config from ``model_args`` options (:func:`decoder_choice`), validated."""
    return decoder_choice(decoder, preset, options).config()


AUTO = "auto"  # batch_size=auto (lm-eval's auto:N, which searches N times, is read as auto: each call chooses)


def batch_size_value(value: int | str | None) -> int | str:
    """lm-eval's ``batch_size``: a whole number >= 1 (None: 1) or ``auto`` (:data:`AUTO`)."""
    if value is None:
        return 1
    if isinstance(value, str) and value.strip().lower().split(":")[0] == AUTO:
        return AUTO
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"batch_size={value}: give a whole number of requests or auto") from None
    if size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {size}")
    return size
