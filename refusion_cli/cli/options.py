"""The options the commands share, each declared once as a typed ``Annotated`` alias, the value parsers
behind them (typer ``parser=``: a bad value is click's one-line usage error), and the one grammar of options
with several values (:func:`spread_values`).

Light on purpose: ``refusion --help`` and a command's ``--help`` import this module and never torch."""

from __future__ import annotations

from collections.abc import Sequence
from copy import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, get_args

import typer

from refusion_cli.errors import UserError


def path_value(value: str | Path) -> Path:
    """A file or folder option: an empty value is refused, where ``Path("")`` would quietly mean the working
    directory (``--output ""`` writing a run's files into it, ``--data-dir ""`` reading from it)."""
    if not str(value).strip():
        raise typer.BadParameter("the path is empty (use '.' for the working directory)")
    return Path(value)


PATH_OPTION = {"parser": path_value, "metavar": "<path>"}  # typer.Option(..., **PATH_OPTION): checked, shown as <path>


def text_value(value: str) -> str:
    """A name option (``--device``, ``--model``): an empty value is refused, where it would quietly mean the default."""
    if not value.strip():
        raise typer.BadParameter("the value is empty (leave the option out for the default)")
    return value


# --causal-fix, --causal-first, --recheck: this toolkit's decoding variants of ReFusion, what each one does
VARIANT_WHAT = {
    "causal_fix": "the causal head's token where the completion step would force a rejected draft",
    "causal_first": "a chosen slot after a committed token starts with the causal head's token when it is the "
                    "surer",
    "recheck": "the completion step's rows are verified again together before they are committed",
}
# in refusion eval and refusion bench, where each adds rows beside the paper's decoder
VARIANT_HELP = {
    "causal_fix": f"also run ReFusion with causal_fix=True, a row of its own: {VARIANT_WHAT['causal_fix']} "
                  "(this toolkit's variant, not the paper's decoder)",
    "causal_first": f"also run ReFusion with causal_first=True, a row of its own: {VARIANT_WHAT['causal_first']} "
                    "(this toolkit's variant; with --causal-fix a row with both too)",
    "recheck": f"also run ReFusion with recheck=True, a row of its own: {VARIANT_WHAT['recheck']} (this toolkit's "
               "variant; with --causal-fix and --causal-first a row with all three too)",
}

SEED_LIMIT = 2**63  # torch generators take seeds below 2**64; bench adds the prompt's index to the seed


def seed_value(value: str | int) -> int:
    """``--seed``: a whole number from 0 to 2**63 - 1 (a larger one overflows the generators' seed)."""
    try:
        seed = int(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a whole number") from None
    if not 0 <= seed < SEED_LIMIT:
        raise typer.BadParameter(f"must be a whole number from 0 to {SEED_LIMIT - 1}, got {seed}")
    return seed


# --- the options eval, bench and chat share -------------------------------------------------------
# A command takes one as ``device: Annotated[str | None, panel_option(DeviceOpt, MACHINE)] = None``: the default
# after ``=``, the help panel and anything else that differs from one command to the next (see :func:`panel_option`)
# where it is used.

LIST_HELP = "; several: separated by spaces or commas"
# the registry's decoders (tests/cli/test_help.py checks they are the same): the registry imports torch, which
# the help must not wait for
DECODER_NAMES = "refusion, ar, llada, dream, llada-fast-dllm, dream-fast-dllm, llada-d2f, dream-d2f"

DecoderOpt = Annotated[str, typer.Option("--decoder", "-d", help=DECODER_NAMES)]  # one decoder (chat)
DecodersOpt = Annotated[list[str] | None, typer.Option("--decoder", "-d", help=DECODER_NAMES + LIST_HELP)]
ModelOpt = Annotated[str | None, typer.Option(  # the checkpoint of the one decoder (chat)
    "--model", parser=text_value, help="checkpoint: embedded name, local directory or hub id, or "
    "DECODER=CHECKPOINT; with a LoRA adapter BASE+ADAPTER or the adapter's folder (default: the decoder's "
    "embedded model, refusion-tiny for refusion)")]
ModelsOpt = Annotated[list[str] | None, typer.Option(
    "--model", help="CHECKPOINT for every decoder, or DECODER=CHECKPOINT for one (embedded name, directory or hub "
    "id; with a LoRA adapter BASE+ADAPTER or the adapter's folder); default: each decoder's embedded model")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="decoder option KEY=VALUE for every decoder that has it, or DECODER.KEY=VALUE for one "
    "(e.g. slot_size=16)")]
PresetOpt = Annotated[str | None, typer.Option(
    "--preset", help="named decoder settings, for each decoder that has them, under --set: ReFusion's per paper "
    "benchmark (gsm8k, math, ...) or synthetic_tiny; the accelerated baselines' (docs/options.md)")]
CausalFixOpt = Annotated[bool, typer.Option("--causal-fix", help=VARIANT_HELP["causal_fix"])]
CausalFirstOpt = Annotated[bool, typer.Option("--causal-first", help=VARIANT_HELP["causal_first"])]
RecheckOpt = Annotated[bool, typer.Option("--recheck", help=VARIANT_HELP["recheck"])]
SeedOpt = Annotated[int, typer.Option("--seed", parser=seed_value)]  # help: what the seed seeds in that command
DeviceOpt = Annotated[str | None, typer.Option("--device", parser=text_value, help="cpu, cuda, cuda:1, ... "
                                               "(default: cuda when available)")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="float32, bfloat16, float16 (default: bf16 on "
                                              "GPUs that have it, else float32)")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="run the modelling code a "
                                                  "checkpoint ships (not needed for LLaDA / Dream)")]


def panel_option(alias: Any, panel: str, *more_names: str, help: str | None = None) -> Any:  # noqa: A002 (typer's)
    """The option of the shared option ``alias`` as one command shows it: under that command's help panel
    ``panel``, with what differs there: ``more_names`` (a short name such as ``-m``) and its own ``help``.
    A parameter names the alias's type with it, which the type checker reads: ``Annotated[str | None,
    panel_option(ModelOpt, MODEL)]``."""
    _, declared = get_args(alias)
    option = copy(declared)  # the alias stays as declared for the other commands
    option.param_decls = (*option.param_decls, *more_names)
    option.rich_help_panel = panel
    if help is not None:
        option.help = help
    return option


# --- options with several values ----------------------------------------------------------------
# One rule for every command: the values of an option that takes several are separated by spaces or commas
# (``--gen-length 64 128 --batch-size 1,8``), or the option is repeated. :func:`spread_values` rewrites the
# arguments into one occurrence per value before click parses them, so a command reads a plain list.


def spread_values(args: list[str], params: Sequence[Any]) -> list[str]:
    """``args`` with each value of a multi-value option among the command's ``params`` (click's) as an
    occurrence of its own: the words after the option up to the next one starting with '-' (or ``--``), each
    split at commas. A value with nothing in it (``--decoder ""``) is kept, for the option to refuse."""
    names = {name for param in params if param.param_type_name == "option" and param.multiple
             and not param.is_flag for name in param.opts}
    spread: list[str] = []
    option: str | None = None  # the multi-value option the words now belong to
    named = False  # whether the next value of ``option`` needs its name before it (the last one has its value)
    for index, arg in enumerate(args):
        if arg == "--":
            return spread + args[index:]
        if arg.startswith("-") and len(arg) > 1:
            name, equals, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
            option = name if name in names else None
            if option is None or not equals:
                spread.append(arg)
                named = False
                continue
            arg, named = value, True
        elif option is None:
            spread.append(arg)
            continue
        for part in split_commas([arg]) or [arg]:
            spread += [option, part] if named else [part]
            named = True
    return spread


@dataclass
class MultiValues:
    """The values of the repeatable options of eval and bench, before they are parsed."""

    decoders: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # CHECKPOINT or DECODER=CHECKPOINT
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE or DECODER.KEY=VALUE
    gen_lengths: list[str] = field(default_factory=list)  # bench
    tasks: list[str] = field(default_factory=list)  # eval
    task_names: frozenset[str] = frozenset()  # the names a stray task may have (eval)


def split_commas(values: list[str] | None) -> list[str]:
    """The values of a multi-value option called directly (the command line has them spread already)."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def option_values(values: list[str] | None, option: str) -> list[str]:
    """The values of a multi-value option; given with nothing in it (``--decoder ""``) is an error, not the
    default."""
    parts = split_commas(values)
    if values and not parts:
        raise UserError(f"{option} is empty", hint=f"leave {option} out for the default")
    return parts


def route_stray_values(stray: list[str], values: MultiValues, command: str) -> MultiValues:
    """Give each stray argument (one before any option: ``refusion eval gsm8k --task math``) to the multi-value
    option its shape belongs to, if that option was used.

    ``DECODER=CHECKPOINT`` -> --model; any other ``KEY=VALUE`` -> --set (or --model when only --model was
    used: a checkpoint path with '=' in it); a whole number -> --gen-length; a task name -> --task; any
    other word -> --decoder. A value whose option was not given is an error.
    """
    from refusion_cli.decoding.registry import DECODERS  # torch: only once a command runs

    for value in split_commas(stray):
        key, equals, _ = value.partition("=")
        if equals and key in DECODERS and values.models:
            values.models.append(value)
        elif equals and values.overrides:
            values.overrides.append(value)
        elif equals and values.models:
            values.models.append(value)
        elif not equals and value.isdigit() and values.gen_lengths:
            values.gen_lengths.append(value)
        elif not equals and value in values.task_names and values.tasks:
            values.tasks.append(value)
        elif not equals and not value.isdigit() and values.decoders:
            values.decoders.append(value)
        else:
            raise UserError(f"unexpected argument '{value}'", hint=f"see {command} --help")
    return values
