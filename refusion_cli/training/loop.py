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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from refusion_cli.decoding.stats import wide_float
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
from refusion_cli.training.objectives import collate, compute_loss, get_objective
from refusion_cli.training.resume import check_resume_settings, resumed_run_finished, trainer_state


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


class TrainObserver:
    """Receives progress on the main process; the CLI renders it. The default ignores everything."""

    def on_start(self, info: RunInfo) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        pass

    def on_save(self, path: Path, step: int) -> None:
        pass

    def on_eval(self, record: EvalRecord) -> None:
        pass

    def on_complete(self, step: int, output: Path) -> None:
        """--resume found the run finished: all its steps done and the final model saved; nothing is trained."""


class StopRequest:
    """Ctrl-C or SIGTERM asks the loop to stop after the current step; a second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
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


def cosine_with_warmup(warmup_steps: int, total_steps: int):
    """LR factor for optimizer step s (0-based): linear warmup to 1, then cosine decay towards 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def follow_schedule(scheduler) -> None:
    """Set the optimizer's learning rate from the schedule at the scheduler's restored step.

    A checkpoint restores the learning rate the old run would have used next; when --steps was
    raised on resume, the schedule (built from the new --steps) says otherwise, and it decides.
    Unchanged --steps give the same value, so an exact resume stays exact.
    """
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate wraps it
    rates = [base * factor(inner.last_epoch) for base, factor in zip(inner.base_lrs, inner.lr_lambdas)]
    for group, rate in zip(inner.optimizer.param_groups, rates):
        group["lr"] = rate
    inner._last_lr = rates


def load_trainable(config: TrainConfig, resume_from: Path | None) -> TrainableModel:
    if resume_from is not None:
        return load_checkpoint_for_training(str(resume_from))
    if config.init is not None:
        return build_tiny_model(config.init, load_tokenizer(config.tokenizer), config.model_config, config.seed)
    return load_checkpoint_for_training(config.model)


def steps_for_epochs(epochs: int, examples: int, batch_size: int) -> int:
    """Optimizer steps that read every example ``epochs`` times (the last batch may run into the next pass)."""
    return math.ceil(epochs * examples / batch_size)


def train_model(config: TrainConfig, observer: TrainObserver | None = None) -> TrainResult:
    """Run (or resume) training as configured; see the module docstring for the steps.

    When the run fails, an output directory this call created and left empty is removed again.
    """
    created = ckpt.missing_dirs(config.output)
    try:
        return _train(config, observer or TrainObserver())
    except BaseException:
        ckpt.remove_empty_dirs(created)
        raise


def _train(config: TrainConfig, observer: TrainObserver) -> TrainResult:
    objective = get_objective(config.objective)
    accelerator = make_accelerator(config)
    main = accelerator.is_main_process

    # 1) data files and output directory, before anything slow
    check_data_file(config.data)
    if config.eval_data is not None:
        check_data_file(config.eval_data, "--eval-data")
    resume_from = ckpt.check_output_dir(config.output, config.resume)
    digests = (file_digest(config.data), file_digest(config.eval_data) if config.eval_data is not None else None)
    settings = config.run_settings(*digests)
    state = ckpt.read_trainer_state(resume_from) if resume_from is not None else None

    def finished() -> TrainResult:
        if main:
            observer.on_complete(config.steps, config.output)
        return TrainResult(config.steps, False, resume_from, config.output, 0, 0.0)

    if state is not None:
        check_resume_settings(state["run"], settings, config)
        if config.epochs is None and resumed_run_finished(state, config):
            return finished()
    micro = micro_batch_size(config.batch_size, accelerator.num_processes, config.grad_accum)

    # 2) model and data
    trainable = load_trainable(config, resume_from)
    model, tokenizer = trainable.model, trainable.tokenizer
    prepare_for_objective(model, objective)
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    data = load_training_data(config.data, tokenizer, config.max_length)
    held_out = None if config.eval_data is None else load_training_data(config.eval_data, tokenizer,
                                                                         config.max_length, "--eval-data")
    if config.epochs is not None:  # the length of the run follows from the examples read
        steps = steps_for_epochs(config.epochs, len(data.examples), config.batch_size)
        settings = replace(config, steps=steps).run_settings(*digests)  # records epochs and steps
        config = replace(config, steps=steps, epochs=None)  # checks --stop-at against these steps
        if state is not None and resumed_run_finished(state, config):
            return finished()

    # 3) Accelerate
    start_step = state["step"] if state is not None else 0
    stream = ShuffledStream(len(data.examples), config.seed, start=start_step * config.batch_size)
    dataset = ObjectiveDataset(data.examples, objective, trainable.mask_token_id, config.seed, config.max_length)
    collate_fn = partial(collate, pad_id=trainable.pad_token_id, weights_dtype=wide_float(accelerator.device))
    # every example's masking draws come from its own (seed, epoch, index) generator, so worker processes
    # build exactly the batches the training process would
    loader = DataLoader(dataset, sampler=stream, batch_size=micro, num_workers=config.num_workers,
                        persistent_workers=config.num_workers > 0, pin_memory=accelerator.device.type == "cuda",
                        collate_fn=collate_fn)
    eval_set, eval_info = None, None
    if held_out is not None:  # LLaDA pads eval responses to the training canvas
        eval_set = HeldOutDataset(held_out.examples, objective, trainable.mask_token_id, config.seed,
                                  config.max_length, response_length=dataset.response_length)
        eval_info = EvalInfo(records=held_out.records, examples=len(held_out.examples),
                             skipped_too_long=held_out.skipped_too_long, every=config.eval_interval,
                             batch_size=config.eval_batch_size or micro)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = round(config.warmup_ratio * config.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(warmup, config.steps))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    check_accumulation(accelerator, config)  # DeepSpeed settles its value in prepare()
    if resume_from is not None:
        accelerator.load_state(str(resume_from / ckpt.ACCELERATE_DIR))
        follow_schedule(scheduler)

    last_step = config.stop_at or config.steps  # where this invocation ends
    info = RunInfo(
        objective=objective.name, start_step=start_step, total_steps=config.steps, records=data.records,
        examples=len(data.examples), skipped_too_long=data.skipped_too_long, global_batch=config.batch_size,
        micro_batch=micro, grad_accum=config.grad_accum, processes=accelerator.num_processes,
        parameters=count_parameters(accelerator.unwrap_model(model)), device=str(accelerator.device),
        mixed_precision=accelerator.mixed_precision, output=config.output, resumed_from=resume_from,
        distributed=distributed_name(accelerator),
        last_step=last_step, evaluation=eval_info)
    if main:
        observer.on_start(info)

    def save(step: int, eval_pending: bool = False) -> Path:
        path = ckpt.checkpoint_path(config.output, step)
        state = trainer_state(step, config, settings, len(data.examples), accelerator.num_processes, eval_pending)
        state["device"] = describe_device(accelerator.device, accelerator.mixed_precision)
        ckpt.save_checkpoint(accelerator, model, tokenizer, path, state)
        if main:
            observer.on_save(path, step)
            if config.keep_checkpoints:
                ckpt.remove_old_checkpoints(config.output, config.keep_checkpoints)
        return path

    def validate(step: int, eval_log) -> None:  # every process scores; the main one writes
        record = evaluate(accelerator, model, eval_set, eval_info.batch_size, collate_fn, step)
        if main:
            eval_log.write(json.dumps(asdict(record)) + "\n")
            eval_log.flush()
            observer.on_eval(record)

    def eval_due(step: int) -> bool:
        return eval_set is not None and (step % config.eval_interval == 0 or step == last_step)

    # 4) train
    evaluate_first = eval_set is not None and (state is None or bool(state.get("eval_pending")))
    log_path, eval_path = config.output / ckpt.LOSS_LOG, config.output / ckpt.EVAL_LOG
    if main:
        if state is not None:
            ckpt.truncate_loss_log(log_path, start_step)
            # a pending evaluation is (re)done: a line a killed run may have written for it goes too
            ckpt.truncate_loss_log(eval_path, start_step - 1 if evaluate_first else start_step)
        else:
            log_path.unlink(missing_ok=True)
            eval_path.unlink(missing_ok=True)
    model.train()
    batches = iter(loader)
    step, last_saved, trained_tokens, trained_seconds = start_step, resume_from, 0, 0.0
    with StopRequest() as stop, appending(log_path, main) as log, \
            appending(eval_path, main and eval_set is not None) as eval_log:
        if evaluate_first:  # a fresh run's baseline (step 0), or the evaluation a stop left to --resume
            validate(start_step, eval_log)
            last_saved = None  # the resumed checkpoint says "pending": unless a later one comes, 5) saves it anew
        started = time.perf_counter()
        while step < last_step:
            step_start = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            totals = optimizer_step(accelerator, model, optimizer, batches, objective, config)
            if not getattr(optimizer, "step_was_skipped", False):  # fp16: the loss scaler skipped an overflow
                scheduler.step()
            step += 1
            totals[4] = float(stop.requested)
            totals = accelerator.reduce(totals, reduction="sum")  # every process agrees on when to stop
            micro_batches = config.grad_accum * accelerator.num_processes
            loss, ar_loss, mdm_loss, tokens, stopping = totals.tolist()  # waits for the step's GPU work too
            now = time.perf_counter()
            record = StepRecord(step=step, loss=loss / micro_batches, ar_loss=ar_loss / micro_batches,
                                mdm_loss=mdm_loss / micro_batches, lr=lr, tokens=int(tokens),
                                seconds=now - step_start, elapsed=now - started)
            trained_tokens += record.tokens
            trained_seconds += record.seconds
            if main:
                log.write(json.dumps(asdict(record)) + "\n")
                log.flush()
                observer.on_step(record)
            if stopping > 0:  # a due evaluation waits for --resume: the checkpoint comes first
                path = save(step, eval_pending=eval_due(step))
                return TrainResult(step, True, path, None, trained_tokens, trained_seconds, stop.signum)
            if eval_due(step):
                validate(step, eval_log)
            if step % config.save_every == 0 or step == last_step:
                last_saved = save(step)

    # 5) final model
    if last_saved is None or last_saved != ckpt.checkpoint_path(config.output, step):
        last_saved = save(step)
    ckpt.save_final(accelerator, model, tokenizer, config.output, last_saved)
    return TrainResult(step, False, last_saved, config.output, trained_tokens, trained_seconds)


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
