"""The settings of a training run: :class:`TrainConfig`, checked where they enter (``__post_init__``).

``refusion train`` builds one from its options (and a recipe's defaults); the loop and the resume checks
trust it. ``run_settings`` is what ``trainer_state.json`` records of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from refusion_cli.errors import UserError
from refusion_cli.training.objectives import get_objective

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass(frozen=True)
class TrainConfig:
    data: Path  # JSONL of {"query", "response"}, {"prompt", "completion"} or {"question", "answer"}
    output: Path  # checkpoints, final model, loss_log.jsonl
    objective: str = "refusion"  # refusion | ar | llada
    model: str | None = None  # checkpoint to start from (embedded name, directory or hub id)
    init: str | None = None  # or: a named fresh config (TINY_CONFIGS) ...
    tokenizer: str | None = None  # ... with this tokenizer
    model_config: dict[str, object] = field(default_factory=dict)  # Qwen3Config overrides for --init
    steps: int = 1000  # optimizer steps in total (a resumed run continues up to this)
    epochs: int | None = None  # or: passes over the data; replaces `steps` by ceil(epochs × examples / batch_size)
    batch_size: int = 8  # global batch: examples per optimizer step over all processes
    lr: float = 2e-5  # peak learning rate (AdamW, linear warmup then cosine to 0)
    max_length: int = 1024  # records with more tokens (prompt + response) are skipped
    save_every: int = 500  # checkpoint every this many steps
    seed: int = 0  # data order, masking draws, and the --init weights
    resume: bool = False  # continue from the last checkpoint in `output`
    grad_accum: int = 1  # micro-batches per optimizer step on each process
    mixed_precision: str | None = None  # no | bf16 | fp16; None: Accelerate's config / environment
    warmup_ratio: float = 0.03  # fraction of `steps` spent warming up
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # gradient clipping; 0 turns it off
    gradient_checkpointing: bool = False
    stop_at: int | None = None  # end this run after this step; the schedule still spans `steps`
    num_workers: int = 0  # DataLoader worker processes building the batches (0: in the training process)
    keep_checkpoints: int = 0  # keep only the newest N checkpoint directories (0: keep all)
    eval_data: Path | None = None  # held-out JSONL (the formats of `data`) scored with the training objective
    eval_every: int | None = None  # evaluate every this many steps; None: every `save_every` steps
    eval_batch_size: int | None = None  # eval examples per forward pass on each process; None: the micro-batch

    def __post_init__(self) -> None:
        get_objective(self.objective)
        if self.epochs is not None and self.epochs < 1:
            raise UserError(f"--epochs must be at least 1 (got {self.epochs})")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps and self.epochs is None:
            raise UserError(f"--stop-at must be between 1 and --steps ({self.steps}), got {self.stop_at}")
        if self.stop_at is not None and self.stop_at < 1:  # with epochs, the steps are known once the data is read
            raise UserError(f"--stop-at must be at least 1 (got {self.stop_at})")
        positive = {"--steps": self.steps, "--batch-size": self.batch_size, "--save-every": self.save_every,
                    "--grad-accum": self.grad_accum, "--eval-every": self.eval_every,
                    "--eval-batch-size": self.eval_batch_size}
        for option, value in positive.items():
            if value is not None and value < 1:
                raise UserError(f"{option} must be at least 1 (got {value})")
        if self.eval_data is None and (self.eval_every is not None or self.eval_batch_size is not None):
            raise UserError("--eval-every and --eval-batch-size go with --eval-data",
                            hint="give --eval-data FILE, a JSONL file of held-out records to score")
        if self.num_workers < 0:
            raise UserError(f"--num-workers cannot be negative (got {self.num_workers})")
        if self.keep_checkpoints < 0:
            raise UserError(f"--keep-checkpoints cannot be negative (got {self.keep_checkpoints}); 0 keeps all")
        if self.max_length < 2:
            raise UserError(f"--max-length must be at least 2 (got {self.max_length})")
        if not 0 <= self.seed < 2**64:  # what torch.manual_seed takes
            raise UserError(f"--seed must be a non-negative 64-bit integer (got {self.seed})")
        if not 0 < self.lr < math.inf:
            raise UserError(f"--lr must be a positive number (got {self.lr})")
        if not 0 <= self.warmup_ratio < 1:
            raise UserError(f"--warmup-ratio must be in [0, 1) (got {self.warmup_ratio})")
        if not (0 <= self.weight_decay < math.inf and 0 <= self.max_grad_norm < math.inf):  # NaN fails too
            raise UserError("--weight-decay and --max-grad-norm must be non-negative numbers")
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            raise UserError(f"--mixed-precision must be one of {', '.join(MIXED_PRECISION)}")
        self._check_source()

    def _check_source(self) -> None:
        if self.model is not None and self.init is not None:
            raise UserError("give either --model (start from a checkpoint) or --init (a fresh model), not both")
        if self.model is None and self.init is None and not self.resume:
            raise UserError("nothing to train: give --model NAME_OR_PATH or --init tiny --tokenizer DIR")
        if self.init is not None and self.tokenizer is None and not self.resume:
            raise UserError("--init needs --tokenizer DIR (the vocabulary of the fresh model)")
        if self.model is not None and self.tokenizer is not None:
            raise UserError("--tokenizer goes with --init; a checkpoint given with --model brings its own")
        if self.model_config and self.init is None:
            raise UserError("--model-config goes with --init; a checkpoint's architecture is fixed")

    @property
    def source(self) -> str | None:
        """What the run starts from, as recorded in trainer_state.json."""
        if self.init is not None:
            return f"init:{self.init}"
        return self.model

    @property
    def eval_interval(self) -> int:
        """Steps between evaluations: --eval-every, else --save-every."""
        return self.eval_every or self.save_every

    def run_settings(self, data_sha256: str, eval_sha256: str | None = None) -> dict[str, object]:
        """The settings trainer_state.json records (the eval ones only for a run with --eval-data)."""
        settings = {"objective": self.objective, "seed": self.seed, "batch_size": self.batch_size, "lr": self.lr,
                    "max_length": self.max_length, "warmup_ratio": self.warmup_ratio,
                    "weight_decay": self.weight_decay, "data_sha256": data_sha256, "source": self.source,
                    "model_config": self.model_config, "steps": self.steps, "grad_accum": self.grad_accum}
        if self.epochs is not None:
            settings["epochs"] = self.epochs
        if eval_sha256 is not None:
            settings |= {"eval_data_sha256": eval_sha256, "eval_every": self.eval_interval}
        return settings
