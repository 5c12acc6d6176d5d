"""Resuming a run (``--resume``): the checks that it continues the interrupted run, and what a checkpoint
records for it.

A resumed run keeps the settings that fix the data order and the optimisation, and continues towards
``--steps`` (which may be raised, never lowered below the checkpoint); a run that did all its steps and
saved its final model is finished, not trained further. :func:`trainer_state` is what
``trainer_state.json`` records; the optimizer, scheduler and RNG states are Accelerate's.
"""

from __future__ import annotations

from typing import Any

from refusion_cli.errors import UserError
from refusion_cli.training import checkpoint as ckpt
from refusion_cli.training.config import TrainConfig

# Settings that fix the data order and the optimisation: a resumed run must use the same.
RESUME_MUST_MATCH = ("objective", "seed", "batch_size", "lr", "max_length", "warmup_ratio", "weight_decay",
                     "data_sha256", "eval_data_sha256", "eval_every")


def resume_mismatch(key: str, recorded: object, current: object) -> str:
    """Why a setting of the resumed run differs from the checkpoint's, in words."""
    if key == "data_sha256":
        return "the data file changed"
    if key == "eval_data_sha256":
        if recorded is None:
            return "the run was trained without --eval-data"
        return "the run was trained with --eval-data; give the same file" if current is None else \
            "the eval data file changed"
    default = " (--eval-every defaults to --save-every)" if key == "eval_every" else ""
    return f"{key} is {current!r} but the checkpoint was trained with {recorded!r}{default}"


def check_resume_settings(recorded: dict, current: dict, config: TrainConfig) -> None:
    for key in RESUME_MUST_MATCH:
        if recorded.get(key) != current.get(key):  # eval settings are recorded by runs with --eval-data only
            raise UserError(f"cannot resume: {resume_mismatch(key, recorded.get(key), current.get(key))}",
                            hint="resume with the settings of the interrupted run")
    if config.source is not None and recorded.get("source") != config.source:
        raise UserError(f"cannot resume: the run started from {recorded.get('source')!r}, not {config.source!r}")


def resumed_run_finished(state: dict, config: TrainConfig) -> bool:
    """Whether the run being resumed already did all its steps and saved its final model (after
    :func:`check_resume_step`)."""
    check_resume_step(state["step"], config)
    return state["step"] == config.steps and ckpt.final_model_step(config.output) == config.steps


def check_resume_step(step: int, config: TrainConfig) -> None:
    """A resumed run continues towards --steps (which may be raised, never lowered below the checkpoint)."""
    if step > config.steps:
        raise UserError(f"cannot resume: the checkpoint is at step {step}, past --steps {config.steps}",
                        hint=f"the LR schedule spans --steps: keep --steps {step} or more")
    if config.stop_at is not None and config.stop_at <= step < config.steps:
        raise UserError(f"cannot resume: --stop-at {config.stop_at} but the run is already at step {step}",
                        hint=f"give a --stop-at after step {step}, or leave it out")


def trainer_state(step: int, config: TrainConfig, settings: dict, examples: int, processes: int,
                  eval_pending: bool = False) -> dict:
    """What trainer_state.json records; optimizer, scheduler and RNG states live in accelerate_state/.

    With --eval-data, ``eval_pending`` says the evaluation of this step was due but left to --resume.
    """
    consumed = step * config.batch_size
    state: dict[str, Any] = {
        "version": ckpt.STATE_VERSION, "step": step, "examples_consumed": consumed,
        "epoch": consumed // examples, "run": settings, "processes": processes,
        "rng": {"seed": config.seed, "data_order": "a permutation per epoch, seeded by (seed, epoch)",
                "samples": "a torch.Generator per example, seeded by (seed, epoch, example index)",
                "process_states": f"{ckpt.ACCELERATE_DIR}/random_states_<process>.pkl"},
        "accelerate_state": ckpt.ACCELERATE_DIR}
    if config.eval_data is not None:
        state["rng"]["eval_samples"] = "a torch.Generator per eval example, seeded by (seed, 'eval', example index)"
        state["eval_pending"] = eval_pending
    return state
