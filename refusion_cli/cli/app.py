"""The Typer application: lists the commands, loads one when it runs, and turns known errors into one line.

A command's module (and torch, transformers, lm-eval behind it) is imported only when that command runs or
shows its help: ``refusion --help`` lists the commands from :data:`COMMANDS` alone."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeGuard

import typer
from typer.core import TyperCommand, TyperGroup

from refusion_cli import __version__
from refusion_cli.cli import lm_eval  # light: lm-eval itself loads when the command runs
from refusion_cli.cli.libraries import libraries_imported
from refusion_cli.cli.options import spread_values
from refusion_cli.cli.output import DEBUG_ENV, console, fail, fail_handled, show_traceback
from refusion_cli.errors import UserError

INTERRUPTED = 130  # exit code after Ctrl-C (128 + SIGINT)


@dataclass(frozen=True)
class CommandEntry:
    """Where a command lives and the line ``refusion --help`` lists it with (its docstring's first line)."""

    module: str
    function: str
    summary: str
    settings: dict[str, Any] = field(default_factory=dict)  # typer's command(...) settings


COMMANDS = {
    "chat": CommandEntry("refusion_cli.cli.chat", "chat",
                         "Chat with a model; answers fill in slot by slot as the decoder commits them."),
    "eval": CommandEntry("refusion_cli.cli.evaluate", "evaluate", "Evaluate decoders on the paper's benchmarks "
                         "(offline, local data) and report accuracy / TPS."),
    "bench": CommandEntry("refusion_cli.cli.bench", "bench", "Compare decoders' speed (TPS, tokens per forward, "
                          "latency, memory) and accuracy on the same prompts."),
    "train": CommandEntry("refusion_cli.cli.train", "train", "Train with the ReFusion objective (or the AR / LLaDA "
                          "baselines); runs under `accelerate launch` too."),
    "serve": CommandEntry("refusion_cli.cli.serve", "serve", "Serve decoders over an OpenAI-compatible API "
                          "(/v1/chat/completions, /v1/completions), with a live web view at /."),
    "lm-eval": CommandEntry("refusion_cli.cli.lm_eval", "lm_eval", "lm-eval's command line with the project's "
                            "decoders registered as models; every argument goes to lm-eval.",
                            {"context_settings": lm_eval.PASS_THROUGH, "add_help_option": False}),
}
HELP_NAMES = ["-h", "--help"]


def plain_types(params: list[Any]) -> list[Any]:
    """``params`` as the help shows them: a flag without a type (typer writes ``<bool>``) or default (a flag's
    default is its absence); a choice as ``<choice>``, its values in its help; so the type column stays narrow
    and the option names whole at 100 columns."""
    for param in params:
        described = getattr(param, "type_descriptor", None)
        if getattr(param, "is_flag", False):
            param.metavar, param.show_default = "", False
        elif param.metavar is None and described is not None and described.is_choice and described.choices:
            values = [str(getattr(choice, "value", choice)) for choice in described.choices]
            if not all(value in (param.help or "") for value in values):
                param.help = f"{param.help or ''} (one of: {', '.join(values)})".strip()
            param.metavar = "<choice>"
    return params


class Command(TyperCommand):
    """A command whose help shows its flags plainly (:func:`plain_types`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return plain_types(super().get_params(ctx))


class Commands(TyperGroup):
    """The commands of :data:`COMMANDS`, each built from its module when it runs; its arguments spread first
    into one occurrence per value of a multi-value option (:func:`~refusion_cli.cli.options.spread_values`)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        # what the list of commands shows (and "Did you mean ...?" reads); the commands themselves load on use
        self.commands = {name: Command(name, help=entry.summary) for name, entry in COMMANDS.items()}

    def get_params(self, ctx: Any) -> list[Any]:
        return plain_types(super().get_params(ctx))

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
        name, _, rest = super().resolve_command(ctx, args)
        assert name is not None  # an unknown name is a usage error
        command = load_command(name)
        return name, command, spread_values(rest, command.get_params(ctx))


def load_command(name: str) -> Any:
    """The click command of ``name``, built from its function; its module and the libraries it brings are
    kept out of the garbage collector's scans (:func:`~refusion_cli.cli.libraries.libraries_imported`)."""
    entry = COMMANDS[name]
    with libraries_imported():
        module = importlib.import_module(entry.module)
    function = getattr(module, entry.function)
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    single.command(name, cls=Command, **entry.settings)(function)
    return typer.main.get_command(single)


def show_version(value: bool) -> None:
    if value:
        console.print(f"refusion {__version__}", highlight=False)
        raise typer.Exit()


app = typer.Typer(
    name="refusion",
    cls=Commands,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": HELP_NAMES},
)


@app.callback()
def refusion(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=show_version,
                                                   help="print the version and exit")] = False) -> None:
    """ReFusion toolkit: decode, evaluate, benchmark and fine-tune slot-parallel diffusion LLMs.

    Errors are one line; add --debug to any command (or set REFUSION_DEBUG=1) to see the traceback too."""


def main() -> None:
    """Console entry point. ``--debug`` anywhere (or REFUSION_DEBUG=1) prints the traceback before the error line;
    the exit code stays the same (2 for a mistake in the input, 130 for Ctrl-C)."""
    # Ctrl-C must interrupt even when the parent started us with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:]
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # read again where a command shows more in debug mode (eval's library output)
    argv = [a for a in argv if a != "--debug"]
    try:
        code = app(args=argv, prog_name="refusion", standalone_mode=False)
    except UserError as exc:
        fail_handled(str(exc), exc.hint)
    except KeyboardInterrupt:
        fail_handled("interrupted", code=INTERRUPTED)
    except Exception as exc:
        if not is_usage_error(exc):
            raise  # a bug, not a user's mistake: the traceback and exit 1
        show_traceback()
        if type(exc).__name__ == "NoArgsIsHelpError":  # `refusion` alone: the help, as click shows it
            app(args=argv, prog_name="refusion", standalone_mode=True)
        command = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "refusion"
        listed = "commands" if type(exc).__name__ == "UsageError" and "command" in exc.format_message() else "options"
        fail(exc.format_message().replace("Value error, ", ""), f"{command} --help lists the {listed}")
    if code == INTERRUPTED:  # Typer turns Ctrl-C inside a command into this return value, without a word
        fail("interrupted", code=INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


class UsageProblem(Protocol):
    """What this module reads of click's UsageError (the command's context, when known, and the message)."""

    ctx: Any

    def format_message(self) -> str: ...


def is_usage_error(exc: Exception) -> TypeGuard[UsageProblem]:
    """A command-line mistake caught by the option parser (click's UsageError, vendored or not)."""
    return any(cls.__name__ in ("UsageError", "BadParameter") for cls in type(exc).__mro__) and \
        hasattr(exc, "format_message")
