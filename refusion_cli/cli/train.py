"""`refusion train`: fine-tune (or pretrain) with the ReFusion, AR or LLaDA objective.

A thin wrapper over :func:`refusion_cli.training.loop.train_model`: parses options, renders
progress with Rich on the main process, and reports the result.
"""

from __future__ import annotations

import signal
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from refusion_cli.cli.libraries import libraries_imported
from refusion_cli.cli.options import PATH_OPTION
from refusion_cli.cli.output import console, quiet_library_output
from refusion_cli.distributed import leave_process_group
from refusion_cli.errors import UserError
from refusion_cli.training.config import MIXED_PRECISION
from refusion_cli.training.modeling import TINY_CONFIGS, parse_model_config
from refusion_cli.training.objectives import OBJECTIVES
from refusion_cli.training.recipes import RECIPES, apply_recipe

if TYPE_CHECKING:
    from refusion_cli.training.evaluation import EvalRecord
    from refusion_cli.training.loop import RunInfo, StepRecord


class ObjectiveName(str, Enum):  # --objective's choices, spelt out for the type checker
    refusion = "refusion"
    ar = "ar"
    llada = "llada"
    dream = "dream"


class PrecisionName(str, Enum):  # --mixed-precision's choices
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


assert {name.value for name in ObjectiveName} == set(OBJECTIVES), "--objective's choices are OBJECTIVES' names"
assert {name.value for name in PrecisionName} == set(MIXED_PRECISION), "--mixed-precision's are MIXED_PRECISION"

SOURCE = "Model"
SCHEDULE = "Optimisation"
RUN = "Run"
VALIDATION = "Validation"


def train(
    ctx: typer.Context,
    data: Annotated[Path, typer.Option("--data", **PATH_OPTION, help="JSONL of {query, response}, "
                                       "{prompt, completion} or {question, answer} records", rich_help_panel=RUN)],
    output: Annotated[Path, typer.Option("--output", **PATH_OPTION, help="directory for checkpoints, the final "
                                         "model and loss_log.jsonl", rich_help_panel=RUN)],
    # not options.ModelOpt: the one checkpoint training starts from (no DECODER=CHECKPOINT, no empty check)
    model: Annotated[str | None, typer.Option("--model", help="checkpoint to start from: embedded name, local "
                                              "directory or hub id", rich_help_panel=SOURCE)] = None,
    init: Annotated[str | None, typer.Option("--init", help=f"start from a fresh model with a named config "
                                             f"({', '.join(TINY_CONFIGS)})", rich_help_panel=SOURCE)] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="tokenizer for --init: a directory, an "
                                                  "embedded model's name or a hub id",
                                                  rich_help_panel=SOURCE)] = None,
    model_config: Annotated[str | None, typer.Option("--model-config", help="JSON object of Qwen3Config overrides "
                                                     "for --init, e.g. '{\"num_hidden_layers\": 2}'",
                                                     rich_help_panel=SOURCE)] = None,
    objective: Annotated[ObjectiveName, typer.Option("--objective", help="refusion (hybrid slot objective), ar, "
                                                     "llada (masked diffusion, bidirectional) or dream (llada with shifted labels)",
                                                     rich_help_panel=SCHEDULE)] = ObjectiveName.refusion,
    recipe: Annotated[str | None, typer.Option("--recipe", help=f"a named set of the options below ("
                                               f"{', '.join(RECIPES)}: the ReFusion reference's fine-tuning); "
                                               "options given explicitly win", rich_help_panel=SCHEDULE)] = None,
    steps: Annotated[int, typer.Option("--steps", help="optimizer steps in total", rich_help_panel=SCHEDULE)] = 1000,
    epochs: Annotated[int | None, typer.Option("--epochs", help="passes over the data instead of --steps (the "
                                               "steps: ceil(epochs × examples / batch size))",
                                               rich_help_panel=SCHEDULE)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="global batch: examples per optimizer step over "
                                            "all processes", rich_help_panel=SCHEDULE)] = 8,
    lr: Annotated[float, typer.Option("--lr", help="peak learning rate (AdamW, warmup then cosine)",
                                      rich_help_panel=SCHEDULE)] = 2e-5,
    max_length: Annotated[int, typer.Option("--max-length", help="longer records (prompt + response tokens) are "
                                            "skipped", rich_help_panel=SCHEDULE)] = 1024,
    warmup_ratio: Annotated[float, typer.Option("--warmup-ratio", help="fraction of --steps spent warming up",
                                                rich_help_panel=SCHEDULE)] = 0.03,
    weight_decay: Annotated[float, typer.Option("--weight-decay", rich_help_panel=SCHEDULE)] = 0.0,
    max_grad_norm: Annotated[float, typer.Option("--max-grad-norm", help="gradient clipping (0: off)",
                                                 rich_help_panel=SCHEDULE)] = 1.0,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="micro-batches per optimizer step on each process",
                                            rich_help_panel=SCHEDULE)] = 1,
    mixed_precision: Annotated[PrecisionName | None, typer.Option("--mixed-precision", help="no, bf16 or fp16 "
                                                                  "(default: Accelerate's config)",
                                                                  rich_help_panel=SCHEDULE)] = None,
    gradient_checkpointing: Annotated[bool, typer.Option("--gradient-checkpointing/--no-gradient-checkpointing",
                                                         help="recompute activations in the backward pass to "
                                                         "save memory", rich_help_panel=SCHEDULE)] = False,
    num_workers: Annotated[int, typer.Option("--num-workers", help="DataLoader processes that build the batches "
                                             "(0: the training process; the batches are the same either way)",
                                             rich_help_panel=SCHEDULE)] = 0,
    save_every: Annotated[int, typer.Option("--save-every", help="checkpoint every N steps",
                                            rich_help_panel=RUN)] = 500,
    keep_checkpoints: Annotated[int, typer.Option("--keep-checkpoints", help="keep only the newest N checkpoints "
                                                  "(0: all)", rich_help_panel=RUN)] = 0,
    # not options.SeedOpt: TrainConfig takes any seed below torch's 2**64, SeedOpt stops at 2**63
    seed: Annotated[int, typer.Option("--seed", help="data order, masking draws and --init weights",
                                      rich_help_panel=RUN)] = 0,
    stop_at: Annotated[int | None, typer.Option("--stop-at", help="end this run after this step (the LR schedule "
                                                "still spans --steps); --resume continues it", rich_help_panel=RUN)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue from the last checkpoint in --output",
                                         rich_help_panel=RUN)] = False,
    eval_data: Annotated[Path | None, typer.Option("--eval-data", **PATH_OPTION, help="held-out JSONL (the formats "
                                                   "of --data) scored with the training objective; writes "
                                                   "eval_log.jsonl", rich_help_panel=VALIDATION)] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="evaluate every N steps, at step 0 and at "
                                                   "the last step (default: --save-every)",
                                                   rich_help_panel=VALIDATION)] = None,
    eval_batch_size: Annotated[int | None, typer.Option("--eval-batch-size", help="eval examples per forward pass "
                                                        "on each process (default: the training micro-batch)",
                                                        rich_help_panel=VALIDATION)] = None,
) -> None:
    """Train with the ReFusion objective (or the AR / LLaDA baselines); runs under `accelerate launch` too."""
    with libraries_imported():
        from refusion_cli.training.config import TrainConfig
        from refusion_cli.training.loop import train_model

    quiet_library_output()
    explicit = given_on_command_line(ctx)
    if {"steps", "epochs"} <= explicit:
        raise UserError("give either --steps or --epochs, not both")
    options = dict(
        data=data, output=output, objective=objective.value, model=model, init=init, tokenizer=tokenizer,
        model_config=parse_model_config(model_config), steps=steps, epochs=epochs, batch_size=batch_size, lr=lr,
        max_length=max_length, save_every=save_every, seed=seed, resume=resume, grad_accum=grad_accum,
        mixed_precision=mixed_precision.value if mixed_precision is not None else None, warmup_ratio=warmup_ratio,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, gradient_checkpointing=gradient_checkpointing,
        stop_at=stop_at, num_workers=num_workers, keep_checkpoints=keep_checkpoints, eval_data=eval_data,
        eval_every=eval_every, eval_batch_size=eval_batch_size,
    )
    config = TrainConfig(**apply_recipe(recipe, options, explicit))
    with ProgressView() as view:
        result = train_model(config, view)
    leave_process_group()  # every process is done before any exits
    if view.active:
        if result.interrupted:
            console.print(f"stopped at step {result.step}; checkpoint saved to {result.checkpoint}", soft_wrap=True)
            console.print("continue with the same command plus --resume")
            if result.stop_signal == signal.SIGTERM:
                raise typer.Exit(128 + signal.SIGTERM)  # 143, as a process ended by SIGTERM
            raise KeyboardInterrupt
        tps = result.tokens / result.seconds if result.seconds > 0 else 0.0
        if result.step < view.total:  # --stop-at: the model is written, the schedule is not over
            console.print(f"stopped at step {result.step} of {view.total} (--stop-at), {tps:,.0f} tokens/s; the "
                          f"model at this step is in {result.final}; continue the schedule with --resume and a later "
                          "--stop-at, or none", soft_wrap=True)
        else:
            steps_done = f"{result.step} step{'s' if result.step != 1 else ''}"
            console.print(f"done: {steps_done}, {tps:,.0f} tokens/s; final model in {result.final}", soft_wrap=True)


def given_on_command_line(ctx: typer.Context) -> set[str]:
    """The options the user typed (not left at their defaults); compared by name, as typer may ship its own click."""
    return {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}


class ProgressView:
    """Rich rendering of the loop's reports, a TrainObserver (the loop only reports on the main process)."""

    LINES = 50  # off a terminal (a log file): about this many progress lines over the schedule

    def __init__(self) -> None:
        self.active = False  # True on the main process, once the run has started
        self.lines = not console.is_terminal  # plain progress lines instead of a live bar
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}{task.fields[val]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=self.lines,
        )
        self.task: TaskID | None = None  # the progress bar's, from on_start on
        self.total = self.last = 0
        self.every = 1

    def __enter__(self) -> ProgressView:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.task is not None:
            self.progress.stop()

    def on_start(self, info: RunInfo) -> None:
        self.active = True
        where = f"resuming {info.resumed_from} at step {info.start_step}" if info.resumed_from else "fresh run"
        mode = "" if info.distributed == "NO" else f" ({info.distributed})"
        console.print(f"[bold]{info.objective}[/] training, {where}: {info.parameters:,} parameters, "
                      f"{info.processes} process(es){mode} on {info.device}, precision {info.mixed_precision}",
                      soft_wrap=True)
        console.print(f"data: {info.examples:,} examples of {info.records:,} records; global batch "
                      f"{info.global_batch} = {info.processes} × {info.grad_accum} × {info.micro_batch}",
                      soft_wrap=True)
        if info.skipped_too_long:
            console.print(f"[yellow]skipped {info.skipped_too_long:,} record(s) longer than --max-length[/]")
        held_out = info.evaluation
        if held_out is not None:
            baseline = "" if info.resumed_from else "at step 0, "
            every = "every step" if held_out.every == 1 else f"every {held_out.every} steps"
            console.print(f"eval data: {held_out.examples:,} examples of {held_out.records:,} records, scored "
                          f"{baseline}{every} and at step {info.last_step}, {held_out.batch_size} per forward pass "
                          "and process", soft_wrap=True)
            if held_out.skipped_too_long:
                console.print(f"[yellow]skipped {held_out.skipped_too_long:,} eval record(s) longer than "
                              "--max-length[/]")
        self.task = self.progress.add_task("train", total=info.total_steps, completed=info.start_step,
                                           loss="-", tps="-", val="")
        self.total, self.last, self.every = info.total_steps, info.last_step, max(1, info.total_steps // self.LINES)
        self.progress.start()

    def on_step(self, record: StepRecord) -> None:
        assert self.task is not None, "on_start comes first"
        self.progress.update(self.task, completed=record.step, loss=f"{record.loss:.4f}",
                             tps=f"{record.tokens_per_second:,.0f}")
        if self.lines and (record.step % self.every == 0 or record.step == self.last):
            hours, rest = divmod(int(record.elapsed), 3600)
            elapsed = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"  # hours keep counting past a day
            console.print(f"step {record.step}/{self.total}  loss {record.loss:.4f} (ar {record.ar_loss:.4f}, "
                          f"mdm {record.mdm_loss:.4f})  lr {record.lr:.3g}  {record.tokens_per_second:,.0f} tok/s  "
                          f"{elapsed}", highlight=False, soft_wrap=True)

    def on_save(self, path: Path, step: int) -> None:
        self.progress.console.print(f"saved checkpoint {path} (step {step})", soft_wrap=True)

    def on_eval(self, record: EvalRecord) -> None:
        assert self.task is not None, "on_start comes first"
        self.progress.update(self.task, val=f", val {record.loss:.4f}")
        self.progress.console.print(f"eval step {record.step}/{self.total}  val loss {record.loss:.4f} (ar "
                                    f"{record.ar_loss:.4f}, mdm {record.mdm_loss:.4f})  {record.examples:,} examples, "
                                    f"{record.tokens:,} tokens, {record.seconds:.1f} s", highlight=False,
                                    soft_wrap=True)

    def on_complete(self, step: int, output: Path) -> None:
        console.print(f"nothing to do: the run in {output} is already complete at step {step} (the final model "
                      "is there); raise --steps to train longer", soft_wrap=True)
