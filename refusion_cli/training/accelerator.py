"""Accelerate for a training run: one process here, DDP / FSDP / DeepSpeed under ``accelerate launch``.

The set-up refuses what would quietly train otherwise than asked: launched processes that Accelerate did not
join into one group, a config whose accumulation differs from ``--grad-accum``, fp16 on CPU, and FSDP or
DeepSpeed asked for where Accelerate would not shard. It also splits the global batch into micro-batches and
turns on activation checkpointing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch

from refusion_cli.errors import UserError
from refusion_cli.training.config import TrainConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# What `accelerate launch` sets for a sharded config -> the distributed type Accelerate then reports.
REQUESTED_SHARDING = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED"}


def launched_processes() -> int:
    """The number of processes a launcher (torchrun, accelerate launch, mpirun) started, from its environment."""
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def make_accelerator(config: TrainConfig):
    try:
        from accelerate import Accelerator
    except ImportError:
        raise UserError("training needs Hugging Face Accelerate", hint="pip install accelerate") from None

    launched = launched_processes()
    # Accelerate only joins CPU processes into one group (gloo) when told it runs on CPU.
    cpu_group = launched > 1 and not torch.cuda.is_available()
    try:
        accelerator = Accelerator(mixed_precision=config.mixed_precision, gradient_accumulation_steps=config.grad_accum,
                                  step_scheduler_with_optimizer=False, cpu=cpu_group)
    except ValueError as exc:
        raise UserError(f"cannot set up training: {str(exc).splitlines()[0]}") from exc
    check_accumulation(accelerator, config)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":  # Accelerate would run fp32
        raise UserError("fp16 mixed precision needs a GPU; on CPU use --mixed-precision bf16 or no")
    if accelerator.num_processes != launched:
        raise UserError(f"{launched} processes were launched but Accelerate set up {accelerator.num_processes}; "
                        "they would train independently", hint="launch with `accelerate launch` or torchrun")
    check_sharding_applied(os.environ, distributed_name(accelerator), accelerator.device)
    return accelerator


def distributed_name(accelerator) -> str:
    """Accelerate's distributed type as a plain string: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, ..."""
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))


def check_sharding_applied(environ: Mapping[str, str], distributed: str, device: torch.device) -> None:
    """A launch config that asks for FSDP or DeepSpeed must get it, not plain data parallelism.

    Accelerate sets up FSDP and DeepSpeed on GPUs (and other accelerators) only: on CPU it reads the
    config, then trains with every process holding the whole model and optimizer, and says nothing.
    """
    for variable, wanted in REQUESTED_SHARDING.items():
        if environ.get(variable, "").lower() == "true" and distributed != wanted:
            raise UserError(f"the Accelerate config asks for {wanted} but Accelerate set up {distributed} on "
                            f"{device.type}: it shards only on GPUs, and this run would not be sharded",
                            hint="train on GPUs, or on CPU leave the config out and launch data-parallel: "
                                 "accelerate launch --multi_gpu --num_processes N -m refusion_cli train ...")


def check_accumulation(accelerator, config: TrainConfig) -> None:
    """An Accelerate or DeepSpeed config may set its own accumulation; it must agree with --grad-accum."""
    if accelerator.gradient_accumulation_steps != config.grad_accum:
        raise UserError(f"the Accelerate/DeepSpeed config accumulates {accelerator.gradient_accumulation_steps} "
                        f"micro-batches per step but --grad-accum is {config.grad_accum}",
                        hint="set gradient_accumulation_steps to 'auto' (or the same number) in that config")


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass (named `gradient_checkpointing` before 5.x)."""
    kwargs = {"use_reentrant": False}  # works with DDP and with frozen inputs
    transformers_model = cast("PreTrainedModel", model)
    if hasattr(model, "activation_checkpointing_enable"):
        transformers_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        transformers_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def micro_batch_size(global_batch: int, processes: int, grad_accum: int) -> int:
    per_step = processes * grad_accum
    if global_batch % per_step:
        raise UserError(f"--batch-size {global_batch} is not divisible by {processes} process(es) × "
                        f"{grad_accum} accumulation step(s)",
                        hint="the global batch is split evenly over processes and accumulation steps")
    return global_batch // per_step


def describe_device(device: torch.device, precision: str) -> str:
    """Where the run trains, for trainer_state.json: e.g. 'cuda:0 (NVIDIA H200), bf16' or 'cpu, no'."""
    name = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    return f"{name}, {precision}"
