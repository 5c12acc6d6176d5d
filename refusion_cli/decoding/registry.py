"""One table of the decoders: each entry holds every fact about one decoder (config class, the
model family it needs, the embedded model it runs on, its presets).

The CLI (eval, bench, chat) and the lm-eval adapters look decoders up here, so every front end
builds configs the same way (``build_config``: preset, then overrides; unknown keys are an error;
the option grammar on top of it is :mod:`refusion_cli.decoding.spec`) and calls every decoder the
same way (``run_decoder``). The decoders themselves accept any model (a mismatch runs, it just
decodes nonsense); the commands and the harness call :func:`check_decoder_fits` once, after the
model is known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from refusion_cli.decoding.config import PRESETS, TOOLKIT_PRESETS, ARConfig, ReFusionConfig, config_from_dict
from refusion_cli.decoding.d2f import DREAM_PRESETS, LLADA_PRESETS, D2FConfig
from refusion_cli.decoding.dream import FAST_DLLM_PRESETS as DREAM_FAST_DLLM_PRESETS
from refusion_cli.decoding.dream import DreamConfig
from refusion_cli.decoding.memory import (ModelSize, RowMemory, ar_memory, d2f_memory, dream_memory, llada_memory,
                                           refusion_memory, row_bytes)
from refusion_cli.decoding.llada import FAST_DLLM_PRESETS as LLADA_FAST_DLLM_PRESETS
from refusion_cli.decoding.llada import LLaDAConfig
from refusion_cli.decoding.rows import (CANVAS, CAUSAL, RowOpener, RowOptions, ar_rows, d2f_rows, dream_rows,
                                        llada_rows, refusion_rows)
from refusion_cli.decoding.stats import EosIds
from refusion_cli.decoding.variants import PAPER, Variant
from refusion_cli.errors import UserError


@dataclass(frozen=True)
class DecoderSpec:
    name: str
    config_class: type
    default_model: str | None  # the embedded model it runs on when no --model is given
    needs_mask: bool  # diffusion decoders need the model's mask token
    bidirectional: bool  # needs a bidirectional (masked-diffusion) model; False: a causal one
    summary: str
    # bumped when the decoder's tokens change for the same config and model, so that eval decodes
    # journaled samples of an earlier revision again instead of reusing them
    revision: int = 1
    presets: Mapping[str, Any] = field(default_factory=dict)  # named configs to start from (--preset)
    # model name -> the preset the decoder starts from on that model when none is chosen (spec.default_config)
    model_presets: Mapping[str, str] = field(default_factory=dict)
    shifted: bool | None = None  # a masked-diffusion decoder reading shifted logits (Dream) or not (LLaDA)
    base: Any = None  # the config it starts from when no preset is chosen (None: the config class's defaults)
    blocks_of: int | None = None  # block_length follows the response: this many tokens when it divides it, else one
    # --protocol paper: the evaluation script whose answer handling the decoder's Table 1 row went through (its
    # authors' or its accelerated baseline's; harness.answers holds each script's rule)
    answer_script: str = "eval.py"
    open_row: RowOpener = field(kw_only=True)  # opens one prompt's row program (decoding.rows)
    row_memory: RowMemory = field(kw_only=True)  # what one row holds at its largest call (decoding.memory)


BASELINE = "ar"  # the autoregressive baseline: bench measures it first and reports every decoder's speed-up over it
LLADA_BLOCK_LENGTH = 32  # LLaDA's block when it divides the length (else one block of the whole length)

DECODERS: dict[str, DecoderSpec] = {
    "refusion": DecoderSpec("refusion", ReFusionConfig, "refusion-tiny", True, False,
                            "ReFusion: slot planning + causal verification, KV reuse", row_memory=refusion_memory, open_row=refusion_rows,
                            presets=MappingProxyType({**PRESETS, **TOOLKIT_PRESETS}),
                            model_presets=MappingProxyType({"refusion-tiny": "synthetic_tiny"})),
    "ar": DecoderSpec("ar", ARConfig, "ar-tiny", False, False, "autoregressive decoding with a KV cache (greedy, or sampled at a temperature)",
                      row_memory=ar_memory, open_row=ar_rows),
    # revision 2 of llada and dream: float64 confidence over the whole vocabulary, leftmost of equal confidences.
    # revision 3 of llada: with use_cache, a cached step always follows a block's full pass, also when that pass
    # finished the block (Fast-dLLM's count of model calls; the tokens are those of revision 2).
    "llada": DecoderSpec("llada", LLaDAConfig, "mdm-tiny", True, True, "LLaDA: semi-autoregressive masked diffusion", row_memory=llada_memory, open_row=llada_rows,
                         revision=3, presets=LLADA_FAST_DLLM_PRESETS, shifted=False, blocks_of=LLADA_BLOCK_LENGTH,
                         answer_script="eval_llada.py"),
    # revision 3 of dream: Fast-dLLM's cached sampler (a block's full pass unmasks its first position only, the
    # cache keeps every position left of the block) and, without a cache, its cap on the tokens a threshold step
    # takes (an even share of the block over steps, cumulated): other tokens than revision 2's for those settings
    "dream": DecoderSpec("dream", DreamConfig, None, True, True,
                         "Dream: masked diffusion with shifted logits (needs a Dream-style model)", revision=3,
                         row_memory=dream_memory, open_row=dream_rows,
                         answer_script="dream eval.py",
                         presets=DREAM_FAST_DLLM_PRESETS, shifted=True),
    # Table 1's Fast-dLLM rows as decoders of their own, so that one run holds them beside LLaDA's and Dream's
    # rows: the llada and dream decoders starting from their fast-dllm preset (blocks of 32, threshold 0.9,
    # prefix and dual cache)
    "llada-fast-dllm": DecoderSpec("llada-fast-dllm", LLaDAConfig, "mdm-tiny", True, True,
                                   "Fast-dLLM on LLaDA: threshold parallel unmasking, prefix and dual KV cache", row_memory=llada_memory, open_row=llada_rows,
                                   revision=3, shifted=False, base=LLADA_FAST_DLLM_PRESETS["fast-dllm"],
                                   answer_script="eval_llada.py",
                                   blocks_of=LLADA_FAST_DLLM_PRESETS["fast-dllm"].block_length),
    "dream-fast-dllm": DecoderSpec("dream-fast-dllm", DreamConfig, None, True, True,
                                   "Fast-dLLM on Dream: threshold parallel unmasking, prefix and dual KV cache", row_memory=dream_memory, open_row=dream_rows,
                                   revision=3, shifted=True, base=DREAM_FAST_DLLM_PRESETS["fast-dllm"],
                                   answer_script="dream eval.py",
                                   blocks_of=DREAM_FAST_DLLM_PRESETS["fast-dllm"].block_length),
    # D2F runs on the checkpoint with D2F's LoRA adapter (--model BASE+ADAPTER, docs/checkpoints.md)
    "llada-d2f": DecoderSpec("llada-d2f", D2FConfig, None, True, True,
                             "D2F on LLaDA: a pipeline of blocks decoded in parallel, finished blocks' K/V cached",
                             row_memory=d2f_memory, open_row=d2f_rows,
                             presets=MappingProxyType(LLADA_PRESETS), shifted=False,
                             answer_script="D2F eval_llada.py"),
    "dream-d2f": DecoderSpec("dream-d2f", D2FConfig, None, True, True,
                             "D2F on Dream: a pipeline of blocks decoded in parallel (shifted logits)", row_memory=d2f_memory, open_row=d2f_rows,
                             presets=MappingProxyType(DREAM_PRESETS), shifted=True,
                             answer_script="dream eval.py"),
}


EMBEDDED_DECODERS = tuple(name for name, spec in DECODERS.items() if spec.default_model is not None)  # run offline

def decoder_spec(name: str) -> DecoderSpec:
    if name not in DECODERS:
        raise UserError(f"unknown decoder '{name}'; choose one of {', '.join(DECODERS)}")
    return DECODERS[name]


def check_decoder_fits(decoder_name: str, bidirectional: bool, force: bool = False, shifted: bool | None = None) -> None:
    """Refuse a decoder / model pairing that cannot work, unless ``force``; unknown decoders always fail.
    ``shifted``: whether a masked-diffusion model was trained to read the token at position i from position
    i-1 (Dream) or at i itself (LLaDA); None when its checkpoint does not say (then either decoder may run)."""
    spec = decoder_spec(decoder_name)
    needs = spec.bidirectional
    if not force and needs and bidirectional and None not in (shifted, spec.shifted) and shifted != spec.shifted:
        trained = "Dream's shifted" if shifted else "LLaDA's unshifted"
        fitting = [name for name, other in DECODERS.items()
                   if other.config_class is spec.config_class and other.shifted == shifted]
        raise UserError(f"the {decoder_name} decoder does not fit this model: it was trained for {trained} logits",
                        hint=f"use the {fitting[0] if fitting else ('dream' if shifted else 'llada')} decoder for it")
    if force or needs == bidirectional:
        return
    if needs:
        raise UserError(
            f"the {decoder_name} decoder needs a bidirectional (masked-diffusion) model, but this model is causal",
            hint="use the refusion or ar decoder for a causal model",
        )
    raise UserError(
        f"the {decoder_name} decoder needs a causal model, but this model is bidirectional (masked-diffusion)",
        hint="use the llada or dream decoder for a bidirectional model",
    )


def build_config(decoder: str, overrides: dict[str, Any] | None = None, base: Any | None = None) -> Any:
    """The decoder's config: ``base`` (a preset) or the defaults, then ``overrides`` (strings allowed)."""
    spec = decoder_spec(decoder)
    if base is not None and not isinstance(base, spec.config_class):
        raise UserError(f"a {type(base).__name__} preset does not fit the {decoder} decoder")
    return config_from_dict(spec.config_class, overrides or {}, base=spec.base if base is None else base)


def length_settings(decoder: str, gen_length: Any, explicit: Any = ()) -> dict[str, int]:
    """Settings that follow the response length unless given in ``explicit``: LLaDA's and Dream's
    samplers unmask one token per step (``steps = gen_length``); LLaDA and the Fast-dLLM decoders use
    blocks of 32 when 32 divides the length, else one block (``DecoderSpec.blocks_of``). A
    ``gen_length`` that is not a positive whole number yields nothing (``build_config`` refuses it)."""
    try:
        length = int(gen_length)
    except (TypeError, ValueError):
        return {}
    if length < 1:
        return {}
    spec = DECODERS.get(decoder)
    values: dict[str, int] = {}
    if spec is not None and spec.config_class in (LLaDAConfig, DreamConfig):
        values["steps"] = length
    if spec is not None and spec.blocks_of is not None:
        values["block_length"] = spec.blocks_of if length % spec.blocks_of == 0 else length
    return {name: value for name, value in values.items() if name not in explicit}


def with_length(decoder: str, values: dict[str, Any], explicit: Any = frozenset()) -> dict[str, Any]:
    """``values`` plus the settings that follow the ``gen_length`` among them (:func:`length_settings`),
    unless given in ``values`` or named in ``explicit``; ``values`` without a ``gen_length`` as they are."""
    if "gen_length" not in values:
        return values
    return {**length_settings(decoder, values["gen_length"], explicit=set(explicit) | set(values)), **values}


def default_model(decoder: str) -> str:
    spec = decoder_spec(decoder)
    if spec.default_model is None:
        raise UserError(f"the {decoder} decoder has no embedded model", hint="pass --model with a checkpoint for it")
    return spec.default_model


def calls_kind(decoder: str, kv_reuse: bool = True) -> tuple[str, bool]:
    """Which shared-calls object rows of ``decoder`` run in (``rows.shared_calls``); rows of one kind share one."""
    return (CANVAS, True) if decoder_spec(decoder).bidirectional else (CAUSAL, kv_reuse)


def row_options(decoder: str, mask_token_id: int | None, eos_token_id: EosIds,
                variant: Variant = PAPER) -> RowOptions:
    return RowOptions(mask_token_id, eos_token_id, bool(decoder_spec(decoder).shifted), variant)


__all__ = ["BASELINE", "DECODERS", "DecoderSpec", "EMBEDDED_DECODERS", "LLADA_BLOCK_LENGTH", "build_config", "calls_kind", "check_decoder_fits",
           "decoder_spec", "default_model", "length_settings", "row_options", "with_length"]


def row_memory_bytes(decoder: str, config: Any, prompt_length: int, size: ModelSize) -> int:
    """Bytes one row of ``decoder`` holds at its largest call, for a prompt of ``prompt_length`` tokens
    (decoding.memory's model)."""
    return row_bytes(decoder_spec(decoder).row_memory(config, prompt_length, size.word), size)
