"""Token-in/token-out decoders. They know nothing of text or tokenizers and never print."""

from refusion_cli.decoding.ar import decode_ar
from refusion_cli.decoding.config import PRESETS, ConfigError, ReFusionConfig, config_from_dict
from refusion_cli.decoding.refusion import StepTrace, decode_refusion
from refusion_cli.decoding.stats import DecodeResult, DecodeStats

__all__ = [
    "PRESETS",
    "ConfigError",
    "DecodeResult",
    "DecodeStats",
    "ReFusionConfig",
    "StepTrace",
    "config_from_dict",
    "decode_ar",
    "decode_refusion",
]
