"""The training loop, on Hugging Face Accelerate: one CPU process here, DDP / FSDP / DeepSpeed elsewhere.

``--batch-size`` is the *global* batch (examples per optimizer step, over all processes and
accumulation steps): the same command trains the same way on one CPU or under ``accelerate
launch`` on many GPUs; each process gets ``batch_size / (processes × grad_accum)`` examples per
micro-batch. The loop does not print: it reports to a :class:`TrainObserver` on the main process.

Steps of a run:
1. check the data file and the output directory (writable; a previous run is only continued with
   ``--resume``; a finished run is reported as such and not trained further);
2. load or build the model, add ``<|beginoftext|>`` and ``<|mask|>`` if it has no mask token, read the
   data (with ``epochs``, the number of steps follows from the examples read);
3. prepare model, optimizer, data loader and scheduler with Accelerate (and load the optimizer,
   scheduler and RNG states when resuming; the data stream restarts after the consumed examples);
4. train, appending one line per step to ``loss_log.jsonl``; checkpoint every ``save_every``
   steps, when Ctrl-C or SIGTERM asks to stop (after the current step), and at the end;
5. save the final model in the output directory.

With ``eval_data`` the run also scores a held-out set (:mod:`refusion_cli.training.evaluation`):
before the first step of a fresh run (step 0, the baseline), every ``eval_every`` steps and at
the run's last step, appending one line per evaluation to ``eval_log.jsonl``. An evaluation comes
before the checkpoint of its step. A stop (Ctrl-C, SIGTERM) does not wait for a due evaluation:
the checkpoint notes it as pending and ``--resume`` runs it first, so the log ends up as an
uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import torch
from torch.utils.data import DataLoader

from refusion_cli.decoding.stats import wide_float
from refusion_cli.errors import UserError
from refusion_cli.training import checkpoint as ckpt
from refusion_cli.training.accelerator import (
    check_accumulation,
    describe_device,
    distributed_name,
    enable_activation_checkpointing,
    make_accelerator,
    micro_batch_size,
)
from refusion_cli.training.config import TrainConfig
from refusion_cli.training.data import (
    HeldOutDataset,
    ObjectiveDataset,
    ShuffledStream,
    TrainingData,
    check_data_file,
    file_digest,
    load_training_data,
)
from refusion_cli.training.evaluation import EvalRecord, evaluate
from refusion_cli.training.modeling import (
    TrainableModel,
    build_tiny_model,
    count_parameters,
    load_checkpoint_for_training,
    load_tokenizer,
    prepare_for_objective,
)
from refusion_cli.training.objectives import Objective, Sample, collate, compute_loss, get_objective
from refusion_cli.training.resume import check_resume_settings, resumed_run_finished, trainer_state
from refusion_cli.training.schedule import cosine_with_warmup, follow_schedule

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler


@dataclass(frozen=True)
class EvalInfo:
    """The held-out set a run scores (--eval-data)."""

    records: int
    examples: int
    skipped_too_long: int
    every: int  # steps between evaluations
    batch_size: int  # eval examples per forward pass on each process


@dataclass(frozen=True)
class RunInfo:
    """What the run is about to do (reported once, before the first step)."""

    objective: str
    start_step: int
    total_steps: int
    records: int
    examples: int
    skipped_too_long: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    processes: int
    parameters: int
    device: str
    mixed_precision: str
    output: Path
    resumed_from: Path | None
    distributed: str = "NO"  # Accelerate's distributed type: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, ...
    last_step: int = 0  # where this invocation ends: --stop-at, else --steps
    evaluation: EvalInfo | None = None  # the held-out set, when --eval-data is given


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as written to loss_log.jsonl."""

    step: int
    loss: float  # mean over the global batch
    ar_loss: float
    mdm_loss: float
    lr: float  # the learning rate this step used
    tokens: int  # real (unpadded) tokens in the global batch
    seconds: float  # wall time of this step
    elapsed: float  # wall time since this process started training

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TrainResult:
    step: int  # optimizer steps done in total
    interrupted: bool  # stopped by Ctrl-C / SIGTERM (a checkpoint was saved)
    checkpoint: Path | None  # the last checkpoint written
    final: Path | None  # the output directory holding the final model, when the run finished
    tokens: int  # tokens trained on by this invocation
    seconds: float  # wall time of its optimizer steps (checkpoint saving excluded)
    stop_signal: int | None = None  # the signal that stopped an interrupted run (on this process)


class TrainObserver(Protocol):
    """Receives progress on the main process; the CLI renders it (any class with these methods). A subclass
    inherits these, which ignore everything."""

    def on_start(self, info: RunInfo) -> None:
        return None

    def on_step(self, record: StepRecord) -> None:
        return None

    def on_save(self, path: Path, step: int) -> None:
        return None

    def on_eval(self, record: EvalRecord) -> None:
        return None

    def on_complete(self, step: int, output: Path) -> None:
        """--resume found the run finished: all its steps done and the final model saved; nothing is trained."""
        return None


class SilentObserver(TrainObserver):
    """Ignores every report: a run nobody watches."""


class StopRequest:
    """Ctrl-C or SIGTERM asks the loop to stop after the current step; a second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = self.signum or signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def load_trainable(config: TrainConfig, resume_from: Path | None) -> TrainableModel:
    if resume_from is not None:
        return load_checkpoint_for_training(str(resume_from))
    if config.init is not None:
        if config.tokenizer is None:  # --resume found no checkpoint, whose tokenizer it would have taken
            raise UserError("--init needs --tokenizer DIR (the vocabulary of the fresh model)")
        return build_tiny_model(config.init, load_tokenizer(config.tokenizer), config.model_config, config.seed)
    if config.model is None:  # --resume found no checkpoint to go on from
        raise UserError("nothing to train: give --model NAME_OR_PATH or --init tiny --tokenizer DIR")
    return load_checkpoint_for_training(config.model)


def steps_for_epochs(epochs: int, examples: int, batch_size: int) -> int:
    """Optimizer steps that read every example ``epochs`` times (the last batch may run into the next pass)."""
    return math.ceil(epochs * examples / batch_size)


@dataclass(frozen=True)
class Run:
    """A run set up to train (steps 1-3): what its optimizer steps, evaluations and checkpoints use."""

    config: TrainConfig  # its `steps` settled (from --epochs once the data is read)
    settings: dict[str, object]  # the run's settings, as trainer_state.json records them
    info: RunInfo  # what the run is about to do, as reported
    objective: Objective
    accelerator: Accelerator
    model: torch.nn.Module  # prepared by Accelerate (wrapped for DDP, FSDP, DeepSpeed)
    tokenizer: object
    optimizer: AcceleratedOptimizer
    scheduler: AcceleratedScheduler
    loader: DataLoader  # this process's micro-batches
    collate_fn: Callable[[list[Sample]], dict[str, torch.Tensor]]
    eval_set: HeldOutDataset | None  # with --eval-data
    observer: TrainObserver  # reported to on the main process


def train_model(config: TrainConfig, observer: TrainObserver | None = None) -> TrainResult:
    """Run (or resume) training as configured; see the module docstring for the steps.

    When the run fails, an output directory this call created and left empty is removed again.
    """
    created = ckpt.missing_dirs(config.output)
    try:
        return _train(config, observer or SilentObserver())
    except BaseException:
        ckpt.remove_empty_dirs(created)
        raise


def _train(config: TrainConfig, observer: TrainObserver) -> TrainResult:
    objective = get_objective(config.objective)
    accelerator = make_accelerator(config)
    main = accelerator.is_main_process

    # 1) data files and output directory, before anything slow
    resume_from, digests = check_inputs(config)
    settings = config.run_settings(*digests)
    state = ckpt.read_trainer_state(resume_from) if resume_from is not None else None
    if state is not None:
        check_resume_settings(state["run"], settings, config)
        if config.epochs is None and resumed_run_finished(state, config):
            return report_finished(config, resume_from, observer, main)
    micro = micro_batch_size(config.batch_size, accelerator.num_processes, config.grad_accum)

    # 2) model and data
    trainable = load_trainable(config, resume_from)
    prepare_for_objective(trainable.model, objective)
    if config.gradient_checkpointing:
        enable_activation_checkpointing(trainable.model)
    data = load_training_data(config.data, trainable.tokenizer, config.max_length)
    held_out = None if config.eval_data is None else load_training_data(config.eval_data, trainable.tokenizer,
                                                                         config.max_length, "--eval-data")
    if config.epochs is not None:  # the length of the run follows from the examples read
        steps = steps_for_epochs(config.epochs, len(data.examples), config.batch_size)
        settings = replace(config, steps=steps).run_settings(*digests)  # records epochs and steps
        config = replace(config, steps=steps, epochs=None)  # checks --stop-at against these steps
        if state is not None and resumed_run_finished(state, config):
            return report_finished(config, resume_from, observer, main)

    # 3) Accelerate
    start_step = state["step"] if state is not None else 0
    run = prepare_run(config, settings, accelerator, objective, trainable, data, held_out, micro=micro,
                      start_step=start_step, resume_from=resume_from, observer=observer)
    if main:
        observer.on_start(run.info)

    # 4) train
    evaluate_first = run.eval_set is not None and (state is None or bool(state.get("eval_pending")))
    log_path, eval_path = config.output / ckpt.LOSS_LOG, config.output / ckpt.EVAL_LOG
    if main:
        start_logs(log_path, eval_path, start_step if state is not None else None, evaluate_first)
    run.model.train()
    batches = iter(run.loader)
    step, last_saved, trained_tokens, trained_seconds = start_step, resume_from, 0, 0.0
    with StopRequest() as stop, appending(log_path, main) as log, \
            appending(eval_path, main and run.eval_set is not None) as eval_log:
        if evaluate_first:  # a fresh run's baseline (step 0), or the evaluation a stop left to --resume
            validate(run, start_step, eval_log)
            last_saved = None  # the resumed checkpoint says "pending": unless a later one comes, 5) saves it anew
        started = time.perf_counter()
        while step < run.info.last_step:
            step += 1
            record, stopping = train_step(run, batches, step, stop, started)
            trained_tokens += record.tokens
            trained_seconds += record.seconds
            if main:
                append_record(log, record)
                observer.on_step(record)
            if stopping:  # a due evaluation waits for --resume: the checkpoint comes first
                path = save(run, step, eval_pending=eval_due(run, step))
                return TrainResult(step, True, path, None, trained_tokens, trained_seconds, stop.signum)
            if eval_due(run, step):
                validate(run, step, eval_log)
            if step % config.save_every == 0 or step == run.info.last_step:
                last_saved = save(run, step)

    # 5) final model
    if last_saved is None or last_saved != ckpt.checkpoint_path(config.output, step):
        last_saved = save(run, step)
    ckpt.save_final(accelerator, run.model, run.tokenizer, config.output, last_saved)
    return TrainResult(step, False, last_saved, config.output, trained_tokens, trained_seconds)


def check_inputs(config: TrainConfig) -> tuple[Path | None, tuple[str, str | None]]:
    """Check the data files and the output directory; return the checkpoint to resume from (None for a fresh
    run) and the SHA-256 digests of the data and eval data files."""
    check_data_file(config.data)
    if config.eval_data is not None:
        check_data_file(config.eval_data, "--eval-data")
    resume_from = ckpt.check_output_dir(config.output, config.resume)
    digests = (file_digest(config.data), file_digest(config.eval_data) if config.eval_data is not None else None)
    return resume_from, digests


def report_finished(config: TrainConfig, resume_from: Path | None, observer: TrainObserver, main: bool) -> TrainResult:
    """--resume found the run finished (all its steps done, the final model saved): nothing is trained."""
    if main:
        observer.on_complete(config.steps, config.output)
    return TrainResult(config.steps, False, resume_from, config.output, 0, 0.0)


def prepare_run(config: TrainConfig, settings: dict[str, object], accelerator: Accelerator, objective: Objective,
                trainable: TrainableModel, data: TrainingData, held_out: TrainingData | None, *, micro: int,
                start_step: int, resume_from: Path | None, observer: TrainObserver) -> Run:
    """Model, optimizer, data loader and LR schedule prepared by Accelerate (their states loaded when resuming)."""
    dataset = ObjectiveDataset(data.examples, objective, trainable.mask_token_id, config.seed, config.max_length)
    collate_fn = partial(collate, pad_id=trainable.pad_token_id, weights_dtype=wide_float(accelerator.device))
    loader = make_loader(dataset, collate_fn, config, micro, start_step, accelerator.device)
    eval_set, eval_info = None, None
    if held_out is not None:  # LLaDA pads eval responses to the training canvas
        eval_set = HeldOutDataset(held_out.examples, objective, trainable.mask_token_id, config.seed,
                                  config.max_length, response_length=dataset.response_length)
        eval_info = EvalInfo(records=held_out.records, examples=len(held_out.examples),
                             skipped_too_long=held_out.skipped_too_long, every=config.eval_interval,
                             batch_size=config.eval_batch_size or micro)
    optimizer = torch.optim.AdamW(trainable.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = round(config.warmup_ratio * config.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(warmup, config.steps))
    model, optimizer, loader, scheduler = accelerator.prepare(trainable.model, optimizer, loader, scheduler)
    check_accumulation(accelerator, config)  # DeepSpeed settles its value in prepare()
    if resume_from is not None:
        accelerator.load_state(str(resume_from / ckpt.ACCELERATE_DIR))
        follow_schedule(scheduler)
    info = RunInfo(
        objective=objective.name, start_step=start_step, total_steps=config.steps, records=data.records,
        examples=len(data.examples), skipped_too_long=data.skipped_too_long, global_batch=config.batch_size,
        micro_batch=micro, grad_accum=config.grad_accum, processes=accelerator.num_processes,
        parameters=count_parameters(accelerator.unwrap_model(model)), device=str(accelerator.device),
        mixed_precision=accelerator.mixed_precision, output=config.output, resumed_from=resume_from,
        distributed=distributed_name(accelerator),
        last_step=config.stop_at or config.steps, evaluation=eval_info)  # last_step: where this invocation ends
    return Run(config, settings, info, objective, accelerator, model, trainable.tokenizer, optimizer, scheduler,
               loader, collate_fn, eval_set, observer)


def make_loader(dataset: ObjectiveDataset, collate_fn: Callable[[list[Sample]], dict[str, torch.Tensor]],
                config: TrainConfig, micro: int, start_step: int, device: torch.device) -> DataLoader:
    """Micro-batches in the run's data order, from the first example a resumed run has not consumed."""
    stream = ShuffledStream(len(dataset), config.seed, start=start_step * config.batch_size)
    # every example's masking draws come from its own (seed, epoch, index) generator, so worker processes
    # build exactly the batches the training process would
    return DataLoader(dataset, sampler=stream, batch_size=micro, num_workers=config.num_workers,
                      persistent_workers=config.num_workers > 0, pin_memory=device.type == "cuda",
                      collate_fn=collate_fn)


def start_logs(log_path: Path, eval_path: Path, resumed_step: int | None, evaluate_first: bool) -> None:
    """A fresh run (``resumed_step`` None) starts the loss and eval logs anew; a resumed one keeps their lines up
    to its checkpoint's step."""
    if resumed_step is None:
        log_path.unlink(missing_ok=True)
        eval_path.unlink(missing_ok=True)
        return
    ckpt.truncate_loss_log(log_path, resumed_step)
    # a pending evaluation is (re)done: a line a killed run may have written for it goes too
    ckpt.truncate_loss_log(eval_path, resumed_step - 1 if evaluate_first else resumed_step)


def train_step(run: Run, batches: Iterator[dict[str, torch.Tensor]], step: int, stop: StopRequest,
               started: float) -> tuple[StepRecord, bool]:
    """Optimizer step ``step`` on every process: its record (over the global batch) and whether to stop after it."""
    step_start = time.perf_counter()
    lr = run.scheduler.get_last_lr()[0]
    totals = optimizer_step(run.accelerator, run.model, run.optimizer, batches, run.objective, run.config)
    if not getattr(run.optimizer, "step_was_skipped", False):  # fp16: the loss scaler skipped an overflow
        run.scheduler.step()
    totals[4] = float(stop.requested)
    totals = run.accelerator.reduce(totals, reduction="sum")  # every process agrees on when to stop
    micro_batches = run.config.grad_accum * run.accelerator.num_processes
    loss, ar_loss, mdm_loss, tokens, stopping = totals.tolist()  # waits for the step's GPU work too
    now = time.perf_counter()
    record = StepRecord(step=step, loss=loss / micro_batches, ar_loss=ar_loss / micro_batches,
                        mdm_loss=mdm_loss / micro_batches, lr=lr, tokens=int(tokens),
                        seconds=now - step_start, elapsed=now - started)
    return record, stopping > 0


def eval_due(run: Run, step: int) -> bool:
    """Whether the held-out set is scored after ``step``: every --eval-every steps and at this invocation's end."""
    return run.eval_set is not None and (step % run.config.eval_interval == 0 or step == run.info.last_step)


def validate(run: Run, step: int, eval_log: TextIO | None) -> None:
    """Score the held-out set after ``step``: every process scores, the main one logs and reports."""
    eval_set, evaluation = run.eval_set, run.info.evaluation
    if eval_set is None or evaluation is None:
        raise ValueError("a run without --eval-data has no held-out set to score")
    record = evaluate(run.accelerator, run.model, eval_set, evaluation.batch_size, run.collate_fn, step)
    if run.accelerator.is_main_process and eval_log is not None:  # the main process's log is open when it scores
        append_record(eval_log, record)
        run.observer.on_eval(record)


def save(run: Run, step: int, eval_pending: bool = False) -> Path:
    """Checkpoint the run after ``step`` (every process takes part); the main process reports it and removes
    checkpoints beyond --keep-checkpoints."""
    path = ckpt.checkpoint_path(run.config.output, step)
    state = trainer_state(step, run.config, run.settings, run.info.examples, run.accelerator.num_processes,
                          eval_pending)
    state["device"] = describe_device(run.accelerator.device, run.accelerator.mixed_precision)
    ckpt.save_checkpoint(run.accelerator, run.model, run.tokenizer, path, state)
    if run.accelerator.is_main_process:
        run.observer.on_save(path, step)
        if run.config.keep_checkpoints:
            ckpt.remove_old_checkpoints(run.config.output, run.config.keep_checkpoints)
    return path


def append_record(log: TextIO, record: StepRecord | EvalRecord) -> None:
    """One JSON line, flushed at once: a killed run keeps every line it wrote."""
    log.write(json.dumps(asdict(record)) + "\n")
    log.flush()


def appending(path: Path, writes: bool) -> AbstractContextManager:
    """``path`` opened for appending on the process that writes it (``writes`` is true); a no-op elsewhere."""
    return open(path, "a") if writes else nullcontext()


def optimizer_step(accelerator, model, optimizer, batches, objective, config: TrainConfig) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches of this process.

    Returns [5] float64 sums (float32 on MPS) over the micro-batches: loss, ar part, mdm part, real
    tokens, and a 0 slot for the stop flag.
    """
    wide = wide_float(accelerator.device)
    totals = torch.zeros(5, dtype=wide, device=accelerator.device)
    for _ in range(config.grad_accum):
        batch = next(batches)
        with accelerator.accumulate(model):  # no gradient sync, optimizer step or zero_grad until the last one
            parts = compute_loss(model, batch, objective)
            accelerator.backward(parts.loss)  # scaled by 1 / grad_accum
            if accelerator.sync_gradients and config.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        totals[:4] += torch.stack([value.to(wide) for value in (parts.loss.detach(), parts.ar_loss, parts.mdm_loss,
                                                                batch["lengths"].sum())])
    if not accelerator.sync_gradients:
        raise RuntimeError("the optimizer step did not happen at the end of the accumulation")
    return totals
