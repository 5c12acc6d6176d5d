"""lm-eval's command line with the project's adapters registered (lm-eval has no plugin discovery).

    python -m refusion_cli.harness --model refusion --model_args pretrained=refusion-tiny,preset=gsm8k \
        --tasks gsm8k_cot --apply_chat_template --batch_size 1

A mistake in the adapters' options (an unknown model_args key, an impossible value, a missing
checkpoint) is one ``error:`` line and exit code 2, as in ``refusion``; REFUSION_DEBUG=1 shows the
traceback too.
"""

import refusion_cli.harness.lm_adapters  # noqa: F401  (registers refusion, ar, llada, dream)
from lm_eval.__main__ import cli_evaluate
from refusion_cli.cli.output import fail_handled
from refusion_cli.errors import UserError

UNKNOWN_TASKS = "Tasks not found"  # how lm-eval's task check begins its ValueError


def as_user_error(exc: Exception) -> UserError | None:
    """The user's mistake behind ``exc``, or None for a bug: the adapters' own errors, lm-eval's report of a
    misspelt task, and a data path left as a placeholder of the templates in evals/tasks."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, FileNotFoundError) and "${" in str(exc):
        return UserError("the task files in evals/tasks are templates whose data paths are filled in by refusion eval",
                         hint="run refusion eval --task NAME once, then pass --include_path results/<run>/tasks/NAME")
    if isinstance(exc, ValueError) and str(exc).startswith(UNKNOWN_TASKS):
        return UserError(str(exc), hint="check --tasks; a task of this project's suite needs --include_path "
                                        "results/<run>/tasks/<name>")
    return None


def main() -> None:
    try:
        cli_evaluate()
    except Exception as exc:
        error = as_user_error(exc)
        if error is None:
            raise
        fail_handled(str(error), error.hint)


if __name__ == "__main__":
    main()
