"""The Typer application: registers the commands and turns known errors into one line."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Protocol, TypeGuard

import typer

from refusion_cli.cli import bench, chat, evaluate, lm_eval, serve, train
from refusion_cli.cli.output import DEBUG_ENV, fail, fail_handled, show_traceback
from refusion_cli.errors import UserError

INTERRUPTED = 130  # exit code after Ctrl-C (128 + SIGINT)

app = typer.Typer(
    name="refusion",
    help="ReFusion toolkit: decode, evaluate, benchmark and fine-tune slot-parallel diffusion LLMs.\n\n"
    "Errors are one line; add --debug to any command (or set REFUSION_DEBUG=1) to see the traceback too.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("chat")(chat.chat)
app.command("eval")(evaluate.evaluate)
app.command("bench")(bench.bench)
app.command("train")(train.train)
app.command("serve")(serve.serve)
app.command("lm-eval", context_settings=lm_eval.PASS_THROUGH, add_help_option=False)(lm_eval.lm_eval)


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
