"""The train loop: exact resume after Ctrl-C, accumulation, multi-process equivalence, saved checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from refusion_cli.errors import UserError
from refusion_cli.models.loading import load_model
from refusion_cli.training.loop import TrainConfig, TrainObserver, train_model
from refusion_cli.training.modeling import ensure_mask_token
from tests.ports import free_port
from tests.tiny import tiny_qwen3
from tests.training.training_helpers import (
    MASK,
    MICRO_CONFIG,
    arithmetic_records,
    make_tokenizer,
    save_tokenizer,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup(tmp_path) -> TrainConfig:
    """A tiny fresh-model run over 24 arithmetic records."""
    data = write_jsonl(tmp_path / "data.jsonl", arithmetic_records(24))
    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    return TrainConfig(data=data, output=tmp_path / "run", init="tiny", tokenizer=str(tokenizer),
                       model_config=MICRO_CONFIG, steps=4, batch_size=4, lr=3e-3, max_length=64, save_every=100,
                       seed=1, warmup_ratio=0.25, mixed_precision="no")


def losses(output: Path) -> list[tuple[int, float, float, float]]:
    lines = (output / "loss_log.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["ar_loss"], r["mdm_loss"]) for r in map(json.loads, lines)]


class CtrlCAfter(TrainObserver):
    """Sends SIGINT to this process when step ``step`` is reported (the loop stops after the next step)."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, record) -> None:
        if record.step == self.step:
            signal.raise_signal(signal.SIGINT)


def test_ctrl_c_saves_a_checkpoint_and_resume_continues_exactly(setup, tmp_path):
    straight = train_model(replace(setup, output=tmp_path / "straight"))
    assert straight.step == 4 and not straight.interrupted

    interrupted = train_model(replace(setup, output=tmp_path / "split"), CtrlCAfter(1))
    assert interrupted.interrupted and interrupted.step == 2
    assert interrupted.checkpoint == tmp_path / "split" / "checkpoint-2"
    assert not (tmp_path / "split" / "config.json").exists()  # no final model yet
    state = json.loads((interrupted.checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["examples_consumed"] == 8

    resumed = train_model(replace(setup, output=tmp_path / "split", resume=True))
    assert resumed.step == 4 and not resumed.interrupted
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # identical, not just close
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stop_at_ends_inside_the_schedule_and_resume_finishes_it(setup, tmp_path):
    straight = train_model(replace(setup, output=tmp_path / "straight"))
    early = train_model(replace(setup, output=tmp_path / "split", stop_at=3))
    assert early.step == 3 and not early.interrupted
    assert (tmp_path / "split" / "model.safetensors").exists()  # a usable model at step 3 of 4
    assert [r[0] for r in losses(tmp_path / "split")] == [1, 2, 3]
    finished = train_model(replace(setup, output=tmp_path / "split", resume=True))
    assert finished.step == straight.step == 4
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    with pytest.raises(UserError, match="--stop-at must be between 1 and --steps"):
        replace(setup, stop_at=5)


def test_raising_steps_on_resume_follows_the_new_schedule_from_the_first_step(setup, tmp_path):
    from refusion_cli.training.loop import cosine_with_warmup

    train_model(replace(setup, output=tmp_path / "run"))  # 4 steps: the last LR is near 0
    longer = replace(setup, output=tmp_path / "run", steps=8, resume=True)
    assert train_model(longer).step == 8
    rates = [json.loads(line)["lr"] for line in (tmp_path / "run" / "loss_log.jsonl").read_text().splitlines()]
    schedule = cosine_with_warmup(round(longer.warmup_ratio * 8), 8)
    assert rates[4:] == pytest.approx([setup.lr * schedule(step) for step in range(4, 8)], rel=1e-12)
    assert rates[4] > rates[3]  # step 5 is not spent at the old schedule's final rate


def test_keep_checkpoints_keeps_the_newest_and_resume_still_works(setup, tmp_path):
    run = replace(setup, output=tmp_path / "run", save_every=1, keep_checkpoints=2, stop_at=3)
    train_model(run)
    assert sorted(p.name for p in run.output.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    train_model(replace(run, stop_at=None, resume=True))
    assert sorted(p.name for p in run.output.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    with pytest.raises(UserError, match="--keep-checkpoints cannot be negative"):
        replace(setup, keep_checkpoints=-1)


def test_dataloader_workers_train_on_the_same_batches(setup, tmp_path):
    train_model(replace(setup, output=tmp_path / "inline"))
    train_model(replace(setup, output=tmp_path / "workers", num_workers=2))
    assert losses(tmp_path / "workers") == losses(tmp_path / "inline")  # same masks, same order, same losses
    with pytest.raises(UserError, match="--num-workers cannot be negative"):
        replace(setup, num_workers=-1)


def test_gradient_accumulation_and_checkpointing_match_the_whole_batch(setup, tmp_path):
    whole = replace(setup, output=tmp_path / "whole", steps=2, objective="llada")
    train_model(whole)
    train_model(replace(whole, output=tmp_path / "accum", grad_accum=2, gradient_checkpointing=True))
    for (_, x, *_), (_, y, *_) in zip(losses(tmp_path / "whole"), losses(tmp_path / "accum"), strict=True):
        assert y == pytest.approx(x, rel=1e-5)


def test_two_processes_give_the_losses_of_one(setup, tmp_path):
    one = replace(setup, output=tmp_path / "one", steps=3, save_every=2)
    train_model(one)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "refusion_cli", "train",
               "--data", str(one.data), "--output", str(tmp_path / "two"),
               "--init", "tiny", "--tokenizer", one.tokenizer, "--model-config", json.dumps(MICRO_CONFIG),
               "--steps", "3", "--batch-size", "4", "--lr", str(one.lr), "--max-length", "64", "--save-every", "2",
               "--seed", "1", "--warmup-ratio", "0.25", "--mixed-precision", "no"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 process(es)" in done.stdout and done.stdout.count("done: 3 steps") == 1  # only rank 0 reports
    for (s1, x, ar1, mdm1), (s2, y, ar2, mdm2) in zip(losses(tmp_path / "one"), losses(tmp_path / "two"),
                                                      strict=True):
        assert s1 == s2 and y == pytest.approx(x, rel=1e-5)
        assert ar2 == pytest.approx(ar1, rel=1e-5) and mdm2 == pytest.approx(mdm1, rel=1e-5)
    assert (tmp_path / "two" / "checkpoint-2" / "accelerate_state").is_dir()


def test_fine_tuning_a_checkpoint_with_llada_saves_a_bidirectional_model(setup, tmp_path):
    base = train_model(replace(setup, output=tmp_path / "base", objective="ar", steps=1))
    tuned = train_model(replace(setup, output=tmp_path / "llada", model=str(base.final), init=None, tokenizer=None,
                                model_config={}, objective="llada", steps=1))
    loaded = load_model(str(tuned.final), device="cpu")
    assert loaded.bidirectional and loaded.model.config.is_causal is False
    assert loaded.mask_token_id == loaded.tokenizer.convert_tokens_to_ids(MASK)
    assert len(loaded.tokenizer) == len(load_model(str(base.final), device="cpu").tokenizer)  # nothing added twice
    assert (tuned.final / "checkpoint-1" / "config.json").is_file()
    state = json.loads((tuned.final / "trainer_state.json").read_text())
    assert state["run"]["source"] == str(base.final) and state["step"] == 1


def test_fresh_model_gets_a_mask_token_when_the_tokenizer_has_none(setup, tmp_path):
    tokenizer = save_tokenizer(tmp_path / "no-mask", with_mask=False)
    result = train_model(replace(setup, output=tmp_path / "ar", tokenizer=str(tokenizer), objective="ar", steps=1))
    loaded = load_model(str(result.final), device="cpu")
    assert not loaded.bidirectional
    assert loaded.mask_token_id == len(loaded.tokenizer) - 1 == loaded.model.config.mask_token_id
    assert loaded.model.config.vocab_size == len(loaded.tokenizer)
    assert loaded.model.config.eos_token_id == loaded.tokenizer.eos_token_id


def test_checkpoint_without_a_mask_token_gets_one_and_a_bigger_embedding():
    tokenizer = make_tokenizer(with_mask=False)
    model = tiny_qwen3(vocab=len(tokenizer))
    model.config.mask_token_id = None
    mask_id = ensure_mask_token(model, tokenizer)
    assert mask_id == len(tokenizer) - 1 and tokenizer.convert_ids_to_tokens(mask_id) == MASK
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) and model.config.mask_token_id == mask_id
    assert ensure_mask_token(model, tokenizer) == mask_id  # idempotent
