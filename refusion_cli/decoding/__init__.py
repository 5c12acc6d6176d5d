"""Token-in/token-out decoders. They know nothing of text or tokenizers and never print.

Every decoder runs through one driver, :func:`~refusion_cli.decoding.engine.run_decoder` (a decoder is
a row program and one registry entry).
"""

from refusion_cli.decoding.config import PRESETS, ARConfig, ConfigError, ReFusionConfig, config_from_dict
from refusion_cli.decoding.d2f import D2FConfig
from refusion_cli.decoding.dream import DreamConfig
from refusion_cli.decoding.registry import check_decoder_fits
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.llada import LLaDAConfig
from refusion_cli.decoding.mdm import MDMStep
from refusion_cli.decoding.refusion import StepTrace
from refusion_cli.decoding.stats import DecodeResult, DecodeStats

__all__ = [
    "PRESETS",
    "ARConfig",
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
    "run_decoder",
]
