"""lm-eval's command line with the project's adapters registered (lm-eval has no plugin discovery).

    python -m refusion_cli.harness --model refusion --model_args pretrained=refusion-tiny,preset=gsm8k \
        --tasks gsm8k_cot --apply_chat_template --batch_size 1

A mistake in the adapters' options (an unknown model_args key, an impossible value, a missing
checkpoint) is one ``error:`` line and exit code 2, as in ``refusion``; REFUSION_DEBUG=1 shows the
traceback too.
"""

import traceback

import refusion_cli.harness.lm_adapters  # noqa: F401  (registers refusion, ar, llada, dream)
from lm_eval.__main__ import cli_evaluate
from refusion_cli.cli.output import debug_enabled, fail
from refusion_cli.errors import UserError

UNKNOWN_TASKS = "Tasks not found"  # how lm-eval's task check begins its ValueError


def main() -> None:
    try:
        cli_evaluate()
    except UserError as exc:
        if debug_enabled():
            traceback.print_exc()
        fail(str(exc), exc.hint)
    except FileNotFoundError as exc:
        if "${" not in str(exc):  # only a data path left as a placeholder of evals/tasks is a user's mistake
            raise
        if debug_enabled():
            traceback.print_exc()
        fail("the task files in evals/tasks are templates whose data paths are filled in by refusion eval",
             "run refusion eval --task NAME once, then pass --include_path results/<run>/tasks/NAME")
    except ValueError as exc:
        if not str(exc).startswith(UNKNOWN_TASKS):  # only lm-eval's report of a misspelt task is a user's mistake
            raise
        if debug_enabled():
            traceback.print_exc()
        fail(str(exc), "check --tasks; a task of this project's suite needs --include_path results/<run>/tasks/<name>")


if __name__ == "__main__":
    main()
