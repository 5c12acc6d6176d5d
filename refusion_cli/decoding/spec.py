"""The one grammar of decoder options: decoder name + checkpoint + preset + overrides -> a validated config.

``refusion eval``, ``refusion bench``, ``refusion chat`` and the lm-eval adapters' ``model_args`` all
read their decoder options here, as strings, the same way:

- ``--decoder NAME``: a name of the registry (refusion, ar, llada, dream, their accelerated forms; a name
  given twice counts once);
- ``--model CHECKPOINT`` gives every selected decoder that checkpoint, ``--model DECODER=CHECKPOINT``
  one decoder (which wins over the shared one); without either a decoder runs on its embedded model;
- ``--set KEY=VALUE`` sets ``KEY`` for every selected decoder whose config has it, ``--set
  DECODER.KEY=VALUE`` for one decoder (which wins over a plain ``KEY=``, whatever their order);
- ``--preset NAME``: named settings from the registry, for every selected decoder that has a preset of
  that name (ReFusion's per-benchmark settings of the paper and the toolkit's own; the accelerated
  baselines' settings), under the ``--set`` overrides. Where none was chosen, the decoder starts from the
  preset the registry names for its model (ReFusion on the embedded refusion-tiny: ``synthetic_tiny``),
  else from a benchmark's own preset (``refusion eval``), else from its defaults: every command gets a
  decoder's defaults from :func:`default_config`, the same way.

A value given twice with two meanings (two values for one key, two checkpoints for every decoder) is
an error, never "the last one wins"; ``DECODER=CHECKPOINT`` given with several checkpoints runs the
decoder on each (``refusion eval``; bench and chat take one, :func:`one_model_each`). Everything is
checked when it is parsed, before a model loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refusion_cli.decoding.config import ConfigError, config_fields
from refusion_cli.decoding.registry import DECODERS, build_config, decoder_spec, default_model, with_length
from refusion_cli.errors import UserError

PRESET_DECODER = "refusion"  # the decoder with a preset for every benchmark, and with the variants


def split_values(values: Sequence[str]) -> list[str]:
    """Values of a repeatable option, each possibly comma-separated, without empty parts."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def parse_assignments(values: Sequence[str], option: str) -> list[tuple[str, str]]:
    """``KEY=VALUE`` pairs; a missing ``=``, key or value is a UserError naming the option."""
    pairs = []
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{option} takes KEY=VALUE, got '{value}'")
        if not rest.strip():
            raise UserError(f"{option} {value}: no value after '='")
        pairs.append((key.strip(), rest.strip()))
    return pairs


def select_decoders(names: Sequence[str]) -> list[str]:
    """The decoders asked for, each once, in the order first given; unknown names are refused."""
    chosen: list[str] = []
    for name in names:
        decoder_spec(name)
        if name not in chosen:
            chosen.append(name)
    if not chosen:
        raise UserError(f"no decoder given; pass --decoder with one or more of {', '.join(DECODERS)}")
    return chosen


def require_refusion(option: str, decoders: Sequence[str], where: str = "given") -> None:
    """An option of the ReFusion decoder alone (a variant's) needs it among the decoders."""
    if PRESET_DECODER not in decoders:
        raise UserError(f"{option} applies to the {PRESET_DECODER} decoder, which is not among the decoders {where} "
                        f"({', '.join(decoders)})", hint=f"add {PRESET_DECODER} to --decoder, or leave {option} out")


def preset_config(name: str, decoder: str = PRESET_DECODER) -> Any:
    """A decoder's preset by name (its registry entry's presets; ReFusion's: the paper's and the toolkit's)."""
    presets = decoder_spec(decoder).presets
    if name not in presets:
        raise ConfigError(f"unknown {decoder} preset '{name}'; choose one of {', '.join(presets) or 'none'}")
    return presets[name]


def check_preset(name: str, decoders: Sequence[str], where: str = "given") -> None:
    """``--preset NAME`` must name a preset of at least one of the ``decoders``."""
    if any(name in decoder_spec(decoder).presets for decoder in decoders):
        return
    known = "; ".join(f"{d}: {', '.join(decoder_spec(d).presets)}" for d in decoders if decoder_spec(d).presets)
    raise UserError(f"--preset {name}: none of the decoders {where} ({', '.join(decoders)}) has a preset of that "
                    f"name", hint=f"presets: {known}" if known else "leave --preset out: these decoders have none")


def parse_models(values: Sequence[str], decoders: Sequence[str]) -> dict[str, list[str]]:
    """Each selected decoder's checkpoints, in the order given: ``CHECKPOINT`` for all, ``DECODER=CHECKPOINT``
    for one (given again with another checkpoint, the decoder runs on each), else the decoder's embedded model."""
    shared: str | None = None
    per_decoder: dict[str, list[str]] = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not value.strip():
            raise UserError("--model is empty", hint="leave --model out for each decoder's embedded model")
        if sep and not key.strip():
            raise UserError(f"--model takes CHECKPOINT or DECODER=CHECKPOINT, got '{value}'",
                            hint="e.g. --model ar=ar-tiny")
        if sep and key in DECODERS:
            if key not in decoders:
                raise UserError(f"--model {value}: the {key} decoder is not selected (--decoder {' '.join(decoders)})")
            if not path.strip():
                raise UserError(f"--model {value}: no checkpoint after '='")
            checkpoints = per_decoder.setdefault(key, [])
            checkpoints += [] if path in checkpoints else [path]
        elif sep and not Path(key).expanduser().exists() and not Path(value).expanduser().exists():
            raise UserError(f"--model {value}: '{key}' is not a decoder; DECODER=CHECKPOINT takes one of "
                            f"{', '.join(DECODERS)}", hint="or give a checkpoint alone, for every decoder")
        else:
            if shared not in (None, value):
                raise UserError(f"--model gives every decoder two checkpoints: {shared} and {value}",
                                hint="DECODER=CHECKPOINT gives one decoder its own checkpoint(s)")
            shared = value
    return {name: per_decoder.get(name) or [shared or default_model(name)] for name in decoders}


def one_model_each(choices: Sequence[DecoderChoice], command: str) -> None:
    """A command that runs a decoder on one checkpoint refuses a decoder given several."""
    seen: dict[str, str | None] = {}
    for choice in choices:
        if choice.decoder in seen:
            raise UserError(f"--model gives {choice.decoder} two checkpoints: {seen[choice.decoder]} and {choice.model}",
                            hint=f"{command} runs each decoder on one checkpoint; refusion eval runs it on each")
        seen[choice.decoder] = choice.model


def parse_overrides(values: Sequence[str], decoders: Sequence[str]) -> dict[str, dict[str, str]]:
    """Each selected decoder's ``--set`` values: ``KEY=VALUE`` for every decoder that has ``KEY``,
    ``DECODER.KEY=VALUE`` for one (written after the plain keys, so it wins)."""
    fields = {d: config_fields(decoder_spec(d).config_class) for d in decoders}
    given: dict[str, str] = {}  # "key" or "decoder.key" -> value
    for key, value in parse_assignments(values, "--set"):
        scope, dot, option = key.rpartition(".")
        if dot and not (scope and option):
            raise UserError(f"--set takes KEY=VALUE or DECODER.KEY=VALUE, got '{key}={value}'",
                            hint="e.g. --set slot_size=16 or --set refusion.slot_size=16")
        if dot and scope not in decoders:
            raise UserError(f"--set {key}={value}: '{scope}' is not a selected decoder ({', '.join(decoders)})")
        if not dot and not any(option in fields[d] for d in decoders):
            known = "; ".join(f"{d}: {', '.join(fields[d])}" for d in decoders)
            raise UserError(f"--set {key}: no selected decoder has an option '{option}' ({known})")
        if given.get(key, value) != value:
            raise UserError(f"--set gives {key} two values: {given[key]} and {value}")
        given[key] = value
    result: dict[str, dict[str, str]] = {name: {} for name in decoders}
    for key in sorted(given, key=lambda k: "." in k):  # plain keys first: a decoder's own value is written last
        scope, _, option = key.rpartition(".")
        for decoder in [scope] if scope else [d for d in decoders if option in fields[d]]:
            result[decoder][option] = given[key]
    return result


@dataclass(frozen=True)
class DecoderChoice:
    """One decoder as the user asked for it: its checkpoint, preset and ``--set`` overrides."""

    decoder: str
    model: str | None = None  # embedded name, local directory or hub id (None: not needed for the config)
    preset: str | None = None  # a preset of this decoder (a --preset the decoder lacks is left out)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config field -> value (strings allowed)

    @property
    def checkpoint(self) -> str:
        """``model``, which every choice of :func:`parse_decoder_options` names (a ValueError for one without)."""
        if self.model is None:
            raise ValueError(f"{self.decoder}: no checkpoint chosen")
        return self.model

    def config(self, gen_length: int | None = None, preset: str | None = None) -> Any:
        """The validated config: the chosen preset, else the model's (:func:`model_preset`), else ``preset``
        (a benchmark's own), then ``gen_length`` and what follows it (LLaDA's and Dream's steps), then the
        overrides, which win."""
        values = dict(self.overrides)
        if gen_length is not None:
            values = {"gen_length": gen_length, **values}
        name = self.preset or model_preset(self.decoder, self.model) or preset
        presets = decoder_spec(self.decoder).presets
        base = presets[name] if name is not None and name in presets else None
        return build_config(self.decoder, with_length(self.decoder, values), base=base)


def model_preset(decoder: str, model: str | None) -> str | None:
    """The preset ``decoder`` starts from on ``model`` when none is chosen (the registry's ``model_presets``:
    ReFusion on the embedded refusion-tiny, ``synthetic_tiny``); None for another or an unknown model."""
    return None if model is None else decoder_spec(decoder).model_presets.get(model)


def default_config(decoder: str, model: str | None, gen_length: int | None = None) -> Any:
    """The config ``decoder`` runs with on ``model`` when no ``--preset`` or ``--set`` is given: what eval (before
    a benchmark's own preset), bench, chat and serve start from."""
    return DecoderChoice(decoder, model).config(gen_length)


def settings_label(decoder: str, config: Any) -> str:
    """A config's fields that differ from the decoder's plain defaults, ``name=value`` each (``gen_length=192
    slot_size=4 block_size=32``), or ``defaults``: with the decoder's name, the whole config."""
    spec = decoder_spec(decoder)
    plain = spec.base if spec.base is not None else spec.config_class()
    changed = [f"{name}={getattr(config, name)}" for name in config_fields(type(config))
               if getattr(config, name) != getattr(plain, name)]
    return " ".join(changed) or "defaults"


def parse_decoder_options(decoders: Sequence[str], models: Sequence[str] = (), sets: Sequence[str] = (),
                          preset: str | None = None) -> list[DecoderChoice]:
    """The decoders, checkpoints, ``--set`` values and preset of one command line, checked."""
    chosen = select_decoders(split_values(decoders))
    if preset is not None:
        check_preset(preset, chosen)
    checkpoints = parse_models(models, chosen)
    overrides = parse_overrides(sets, chosen)
    return [DecoderChoice(name, checkpoint, preset if preset in decoder_spec(name).presets else None, overrides[name])
            for name in chosen for checkpoint in checkpoints[name]]


__all__ = ["DecoderChoice", "check_preset", "default_config", "model_preset", "parse_assignments",
           "parse_decoder_options", "one_model_each", "parse_models", "parse_overrides", "preset_config",
           "require_refusion", "select_decoders", "settings_label", "split_values"]
