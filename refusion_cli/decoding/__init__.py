"""Token-in/token-out decoders. They know nothing of text or tokenizers and never print."""

from refusion_cli.decoding.ar import decode_ar
from refusion_cli.decoding.config import PRESETS, ConfigError, ReFusionConfig, config_from_dict
from refusion_cli.decoding.d2f import D2FConfig, decode_d2f
from refusion_cli.decoding.dream import DreamConfig, decode_dream
from refusion_cli.decoding.registry import check_decoder_fits
from refusion_cli.decoding.llada import LLaDAConfig, decode_llada
from refusion_cli.decoding.mdm import MDMStep
from refusion_cli.decoding.refusion import StepTrace, decode_refusion
from refusion_cli.decoding.stats import DecodeResult, DecodeStats

__all__ = [
    "PRESETS",
    "ConfigError",
    "D2FConfig",
    "DecodeResult",
    "DecodeStats",
    "DreamConfig",
    "LLaDAConfig",
    "MDMStep",
    "ReFusionConfig",
    "StepTrace",
    "check_decoder_fits",
    "config_from_dict",
    "decode_ar",
    "decode_d2f",
    "decode_dream",
    "decode_llada",
    "decode_refusion",
]
