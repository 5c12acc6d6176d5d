"""`refusion lm-eval [LM-EVAL ARGS...]`: lm-eval's own command line with the project's adapters registered.

    refusion lm-eval run --model refusion --model_args pretrained=refusion-tiny,preset=gsm8k \\
        --tasks gsm8k_cot --apply_chat_template --batch_size 1

Every argument goes to lm-eval unchanged (``refusion lm-eval --help`` is lm-eval's help). lm-eval has
no plugin discovery, so the command imports the adapters (``refusion``, ``ar``, ``llada``, ``dream``)
first. A mistake in the adapters' options (an unknown model_args key, an impossible value, a missing
checkpoint), a misspelt task or a task template run without its data is one ``error:`` line and exit
code 2, as in the other commands.
"""

from __future__ import annotations

import sys

import typer

from refusion_cli.cli.libraries import libraries_imported
from refusion_cli.errors import UserError

UNKNOWN_TASKS = "Tasks not found"  # how lm-eval's task check begins its ValueError
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}  # every argument lands in ctx.args


def lm_eval(ctx: typer.Context) -> None:
    """lm-eval's command line with the project's decoders registered as models; every argument goes to lm-eval."""
    with libraries_imported():
        import refusion_cli.harness.lm_adapters  # noqa: F401  (registers every decoder of the registry)
        from lm_eval.__main__ import cli_evaluate

    saved_argv = sys.argv
    sys.argv = ["lm-eval", *ctx.args]  # cli_evaluate takes no arguments: its parser reads sys.argv
    try:
        cli_evaluate()
    except UserError:
        raise
    except Exception as exc:
        error = as_user_error(exc)
        if error is None:
            raise
        raise error from exc
    finally:
        sys.argv = saved_argv


def as_user_error(exc: Exception) -> UserError | None:
    """The user's mistake behind one of lm-eval's exceptions, or None for a bug: lm-eval's report of a misspelt
    task, and a data path left as a placeholder of the templates in evals/tasks."""
    if isinstance(exc, FileNotFoundError) and "${" in str(exc):
        return UserError("the task files in evals/tasks are templates whose data paths are filled in by refusion eval",
                         hint="run refusion eval --task NAME once, then pass --include_path runs/<run>/tasks/NAME (or the --output folder)")
    if isinstance(exc, ValueError) and str(exc).startswith(UNKNOWN_TASKS):
        return UserError(str(exc), hint="check --tasks; a task of this project's suite needs --include_path "
                                        "runs/<run>/tasks/<name> (or the --output folder)")
    return None
