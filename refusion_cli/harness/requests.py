"""lm-eval's generation requests as the adapters serve them: the generation keys checked, a request prepared
for a decoder (its prompt ids, config and stop strings), and what
one decoded request gives back (:class:`SampleRecord`, which a :class:`GenerationHook` such as the journal sees)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from lm_eval.api.instance import Instance

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.spec import DecoderChoice
from refusion_cli.decoding.stats import DecodeStats
from refusion_cli.errors import UserError
from refusion_cli.harness.model_args import as_bool

SAMPLING_KEYS = frozenset({"do_sample", "temperature", "top_p", "top_k"})  # accepted when they ask for greedy decoding


@dataclass
class SampleRecord:
    """One decoded request: the text lm-eval receives and the decode's counts."""

    text: str  # the response as the answer rule hands it to the task (end token, special tokens, ``until``)
    prompt_tokens: int  # the prompt as decoded (after any cut)
    stats: DecodeStats  # forwards, tokens (up to EOS), seconds; tps and tpf derived
    prompt_cut: int = 0  # tokens cut from the prompt's start to fit the model's positions
    batch_rows: int = 1  # the most requests decoded together so far in its run (1: one at a time)
    wall_share: float | None = None  # with batch_rows > 1: wall seconds since the run's previous sample finished


@dataclass(frozen=True)
class PreparedRequest:
    """A generation request ready to decode."""

    prompt_ids: list[int]
    config: Any  # the adapter's config with the request's max_gen_toks
    until: list[str]  # stop strings
    cut: int  # tokens cut from the prompt's start


class GenerationHook(Protocol):
    """Sees the generation requests of an adapter (the harness's journal implements it)."""

    def start(self, requests: list[Instance]) -> None:
        """The requests of one ``generate_until`` call, before any is served."""

    def lookup(self, request: Instance) -> str | None:
        """A stored output for ``request`` (then it is not decoded), or None."""

    def record(self, request: Instance, sample: SampleRecord) -> None:
        """``request`` was just decoded."""


def with_gen_length(config: Any, gen_length: int, choice: DecoderChoice | None = None) -> Any:
    """``config`` with another response budget (lm-eval's ``max_gen_toks``). Built from ``choice`` (the
    ``model_args`` options) when there is one, so that the settings that follow the length move with it
    (``registry.with_length``, the rule ``refusion eval`` applies) unless the options set them; a config
    given as an object keeps its other fields."""
    if config.gen_length == gen_length:
        return config
    try:
        if choice is not None:
            options = {key: value for key, value in choice.overrides.items() if key != "gen_length"}
            return dataclasses.replace(choice, overrides=options).config(gen_length)
        return dataclasses.replace(config, gen_length=gen_length)
    except ConfigError as exc:
        raise UserError(f"max_gen_toks={gen_length} does not fit the {type(config).__name__}: {exc}",
                        hint="set gen_length (and steps / block_length for the MDM decoders) so that they agree") from exc


def asks_for_sampling(gen_kwargs: dict[str, Any]) -> bool:
    """Whether lm-eval's generation keys ask for sampling, read as lm-eval's HF model reads them:
    ``do_sample`` when given, else a ``temperature`` above 0."""
    do_sample = gen_kwargs.get("do_sample")
    if do_sample is not None:
        return as_bool("do_sample", do_sample)
    try:
        return float(gen_kwargs.get("temperature") or 0.0) > 0.0
    except (TypeError, ValueError):
        raise UserError(f"generation key 'temperature' must be a number, got {gen_kwargs['temperature']!r}") from None


def stop_strings(gen_kwargs: dict[str, Any]) -> list[str]:
    until = gen_kwargs.get("until") or []
    if isinstance(until, str):
        return [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise UserError(f"generation key 'until' must be a string or a list of strings, got {until!r}")
    return list(until)
