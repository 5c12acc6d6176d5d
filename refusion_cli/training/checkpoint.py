"""Checkpoints: ordinary transformers directories plus what a resumed run needs.

Layout of ``--output DIR``::

    DIR/checkpoint-<step>/            periodic, on Ctrl-C, and at the end
        config.json, model.safetensors, tokenizer files   (loads with from_pretrained / refusion chat)
        trainer_state.json            step, data position, the run's settings, the RNG scheme
        accelerate_state/             optimizer, LR scheduler, RNG states (Accelerator.save_state)
    DIR/config.json, model.safetensors, ...   the final model (when the run finishes)
    DIR/loss_log.jsonl                one JSON line per optimizer step
    DIR/eval_log.jsonl                one JSON line per evaluation (with --eval-data)

A checkpoint is written to ``checkpoint-<step>.partial`` and renamed when complete, so a run killed
while saving never leaves a checkpoint that ``--resume`` would pick up half-written. Every process takes
part in saving one (the weights are gathered from all shards, each process saves its RNG state); the main
process writes the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from refusion_cli.errors import UserError

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
ACCELERATE_DIR = "accelerate_state"
LOSS_LOG = "loss_log.jsonl"
EVAL_LOG = "eval_log.jsonl"
STATE_VERSION = 1


def checkpoint_path(output: Path, step: int) -> Path:
    return output / f"{CHECKPOINT_PREFIX}{step}"


def list_checkpoints(output: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``output``, oldest first."""
    found = []
    if output.is_dir():
        for child in output.iterdir():
            match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", child.name)
            if match and (child / STATE_FILE).is_file() and (child / ACCELERATE_DIR).is_dir():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output: Path) -> Path | None:
    checkpoints = list_checkpoints(output)
    return checkpoints[-1][1] if checkpoints else None


def remove_old_checkpoints(output: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints under ``output`` (--keep-checkpoints)."""
    for _, old in list_checkpoints(output)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def check_output_dir(output: Path, resume: bool) -> Path | None:
    """Fail early when ``output`` is not writable or would be overwritten; return the checkpoint to resume."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UserError(f"cannot write checkpoints to '{output}': {reason}",
                        hint="choose an --output directory you can write to") from None
    latest = latest_checkpoint(output)
    if resume:
        if latest is None:
            raise UserError(f"--resume: '{output}' holds no checkpoint to resume from",
                            hint="start without --resume, or point --output at the interrupted run")
        return latest
    if latest is not None or (output / STATE_FILE).exists():
        raise UserError(f"'{output}' already holds a training run",
                        hint="pass --resume to continue it, or choose another --output")
    return None


def missing_dirs(output: Path) -> list[Path]:
    """The directories that creating ``output`` would make, deepest first."""
    missing = []
    for directory in (output, *output.parents):
        if directory.exists() or directory.is_symlink():
            break
        missing.append(directory)
    return missing


def remove_empty_dirs(directories: list[Path]) -> None:
    """Remove those of ``directories`` (deepest first) that are empty: a failed run leaves nothing behind."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (or already gone): keep it, and its parents
            return


def final_model_step(output: Path) -> int | None:
    """The step of the final model in ``output`` (None when the run has not finished)."""
    try:
        return int(json.loads((output / STATE_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_trainer_state(checkpoint: Path) -> dict:
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {checkpoint / STATE_FILE}: {exc}") from exc
    if state.get("version") != STATE_VERSION:
        raise UserError(f"{checkpoint / STATE_FILE} was written by an incompatible version of the trainer")
    return state


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def replace_dir(source: Path, target: Path) -> None:
    """Move the completed ``source`` into place as ``target`` (an older ``target`` is removed)."""
    if target.exists():
        shutil.rmtree(target)
    source.rename(target)


def truncate_loss_log(path: Path, last_step: int) -> None:
    """Keep the log lines of steps up to ``last_step`` (a resumed run rewrites the rest); for the eval log too."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def share_tied_tensors(state_dict: dict[str, torch.Tensor] | None,
                       model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """``state_dict`` with every name of one tied parameter (Qwen3's input embedding and output head when
    ``tie_word_embeddings``) holding the same tensor; a process that got no state dict (None) passes it on.

    A gathered sharded state dict (FSDP) has a separate copy under each name; ``save_pretrained`` drops
    the tied names only when they share storage, and would otherwise write the copy too.
    """
    if state_dict is None:
        return None
    shared = dict(state_dict)
    first_names: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        first = first_names.setdefault(id(parameter), name)
        if first != name and first in shared and name in shared:
            shared[name] = shared[first]
    return shared


def save_model_files(accelerator, model, tokenizer, directory: Path) -> None:
    """config.json + weights + tokenizer, as ``from_pretrained`` reads them (weights gathered from all shards)."""
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP / DeepSpeed: every process calls it
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(directory, is_main_process=accelerator.is_main_process,
                              state_dict=share_tied_tensors(state_dict, unwrapped))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(directory)


def save_checkpoint(accelerator, model, tokenizer, path: Path, trainer_state: dict) -> None:
    """Write a complete checkpoint to ``path`` (via ``path.partial``, renamed once complete)."""
    partial_path = path.with_name(path.name + ".partial")
    if accelerator.is_main_process:
        if partial_path.exists():
            shutil.rmtree(partial_path)
        partial_path.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_model_files(accelerator, model, tokenizer, partial_path)
    accelerator.save_state(str(partial_path / ACCELERATE_DIR))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(partial_path / STATE_FILE, trainer_state)
        replace_dir(partial_path, path)
    accelerator.wait_for_everyone()


def save_final(accelerator, model, tokenizer, output: Path, checkpoint: Path) -> None:
    """The finished model at the top of the output directory (no optimizer state)."""
    save_model_files(accelerator, model, tokenizer, output)
    if accelerator.is_main_process:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        write_json(output / STATE_FILE, {**state, "checkpoint": checkpoint.name})
    accelerator.wait_for_everyone()
