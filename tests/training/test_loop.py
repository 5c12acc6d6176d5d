"""The train loop: exact resume after Ctrl-C, accumulation, multi-process equivalence, saved checkpoints,
the validation loss (--eval-data) beside them, and FSDP configs refused where Accelerate would not shard."""

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
from refusion_cli.training.accelerator import check_sharding_applied
from refusion_cli.training.checkpoint import share_tied_tensors
from refusion_cli.training.config import TrainConfig
from refusion_cli.training.loop import TrainObserver, train_model
from refusion_cli.training.modeling import build_tiny_model, ensure_mask_token
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
# docs/training.md's FSDP config ("Several GPUs or nodes"), at 2 processes and without bf16
README_FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: 'no'
num_machines: 1
num_processes: 2
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
"""


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


def validations(output: Path) -> list[dict]:
    """eval_log.jsonl without the wall times."""
    lines = (output / "eval_log.jsonl").read_text().splitlines()
    return [{key: value for key, value in json.loads(line).items() if key != "seconds"} for line in lines]


def with_eval_data(config: TrainConfig, tmp_path: Path, **eval_options) -> TrainConfig:
    """The run, scoring 7 more arithmetic records as held-out data, every 2 steps unless told otherwise."""
    eval_data = write_jsonl(tmp_path / "eval.jsonl", arithmetic_records(31)[24:])
    return replace(config, eval_data=eval_data, **{"eval_every": 2, **eval_options})


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


@pytest.mark.parametrize("objective", ["refusion", "llada"])
def test_validation_leaves_the_training_losses_and_weights_bit_identical(setup, tmp_path, objective):
    plain = replace(setup, output=tmp_path / "plain", objective=objective)
    train_model(plain)
    scored = with_eval_data(replace(plain, output=tmp_path / "scored"), tmp_path, eval_every=1, eval_batch_size=3)
    train_model(scored)
    assert losses(scored.output) == losses(plain.output)
    a, b = load_file(plain.output / "model.safetensors"), load_file(scored.output / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = validations(scored.output)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # the baseline, then every step
    assert all(r["examples"] == 7 and r["tokens"] == records[0]["tokens"] for r in records)
    assert records[-1]["loss"] < records[0]["loss"]  # the held-out arithmetic is learnt too
    state = json.loads((scored.output / "trainer_state.json").read_text())
    assert state["run"]["eval_every"] == 1 and len(state["run"]["eval_data_sha256"]) == 64
    assert "eval_every" not in json.loads((plain.output / "trainer_state.json").read_text())["run"]


@pytest.mark.parametrize("signal_after", [1, 2, 3])  # stops at step 2 (evaluation due), 3 (not due), 4 (the last)
def test_resume_after_a_stop_writes_the_eval_log_of_an_uninterrupted_run(setup, tmp_path, signal_after):
    straight = with_eval_data(replace(setup, output=tmp_path / "straight"), tmp_path)
    train_model(straight)
    assert [r["step"] for r in validations(straight.output)] == [0, 2, 4]

    split = replace(straight, output=tmp_path / "split")
    interrupted = train_model(split, CtrlCAfter(signal_after))
    stopped = signal_after + 1
    assert interrupted.interrupted and interrupted.step == stopped
    state = json.loads((interrupted.checkpoint / "trainer_state.json").read_text())
    assert state["eval_pending"] == (stopped % 2 == 0)  # a due evaluation is left to --resume, not waited for
    assert [r["step"] for r in validations(split.output)] == [s for s in (0, 2) if s < stopped]
    resumed = train_model(replace(split, resume=True))
    assert resumed.step == 4 and not resumed.interrupted
    assert validations(split.output) == validations(straight.output)  # identical values, not just close
    assert losses(split.output) == losses(straight.output)
    assert json.loads((split.output / "trainer_state.json").read_text())["eval_pending"] is False


def test_resume_drops_evaluations_after_the_checkpoint_and_redoes_a_pending_one(setup, tmp_path):
    straight = with_eval_data(replace(setup, output=tmp_path / "straight", save_every=2), tmp_path, eval_every=1)
    train_model(straight)
    split = replace(straight, output=tmp_path / "split")
    train_model(split, CtrlCAfter(2))  # stops at step 3 with its evaluation pending
    log = split.output / "eval_log.jsonl"
    lines = log.read_text().splitlines()
    extra = {**json.loads(lines[-1]), "step": 3, "loss": 123.0}  # as if a killed run had scored step 3 too
    log.write_text("\n".join([*lines, json.dumps(extra), json.dumps({**extra, "step": 4})]) + "\n")
    train_model(replace(split, resume=True))
    assert validations(split.output) == validations(straight.output)


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
    from refusion_cli.training.schedule import cosine_with_warmup

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


def launch_train(launcher_options: list[str], config: TrainConfig, output: Path) -> subprocess.CompletedProcess:
    """`accelerate launch [launcher_options] -m refusion_cli train` on CPU with the settings of ``config`` (a fresh
    --init run, with its --eval-data if any), writing to ``output``."""
    evaluation = ["--eval-data", str(config.eval_data), "--eval-every", str(config.eval_interval)] \
        if config.eval_data else []
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher_options,
               "--main_process_port", str(free_port()), "-m", "refusion_cli", "train",
               "--data", str(config.data), "--output", str(output),
               "--init", "tiny", "--tokenizer", config.tokenizer, "--model-config", json.dumps(MICRO_CONFIG),
               "--steps", str(config.steps), "--batch-size", str(config.batch_size), "--lr", str(config.lr),
               "--max-length", str(config.max_length), "--save-every", str(config.save_every),
               "--seed", str(config.seed), "--warmup-ratio", str(config.warmup_ratio), "--mixed-precision", "no",
               *evaluation]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # `make test-all` (22 s: accelerate and two training processes start); by default the tests above
# check the batches, accumulation and resume of one process
def test_two_processes_give_the_training_and_validation_losses_of_one(setup, tmp_path):
    one = with_eval_data(replace(setup, output=tmp_path / "one", steps=3, save_every=2), tmp_path)
    train_model(one)
    done = launch_train(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                         "--dynamo_backend", "no"], one, tmp_path / "two")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 process(es)" in done.stdout and done.stdout.count("done: 3 steps") == 1  # only rank 0 reports
    for (s1, x, ar1, mdm1), (s2, y, ar2, mdm2) in zip(losses(tmp_path / "one"), losses(tmp_path / "two"),
                                                      strict=True):
        assert s1 == s2 and y == pytest.approx(x, rel=1e-5)
        assert ar2 == pytest.approx(ar1, rel=1e-5) and mdm2 == pytest.approx(mdm1, rel=1e-5)
    assert (tmp_path / "two" / "checkpoint-2" / "accelerate_state").is_dir()
    # 7 eval examples: shares of 4 and 3, in batches of 2 (each process's micro-batch) instead of 4. At step 0 the
    # weights are the same: a float32 example's loss moves by rounding at most with the batching (it does not move
    # here); later the weights differ as the training losses do, so the same rel=1e-5
    assert done.stdout.count("eval step ") == 3
    one_eval, two_eval = validations(tmp_path / "one"), validations(tmp_path / "two")
    assert [r["step"] for r in two_eval] == [0, 2, 3]
    for a, b in zip(one_eval, two_eval, strict=True):
        assert (a["step"], a["examples"], a["tokens"]) == (b["step"], b["examples"], b["tokens"])
        for key in ("loss", "ar_loss", "mdm_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-6 if a["step"] == 0 else 1e-5), (a["step"], key)


@pytest.mark.slow  # `make test-all`: starts accelerate (the sharded-config checks below run by default)
def test_the_readme_fsdp_config_on_cpu_stops_before_training_unsharded(setup, tmp_path):
    """Accelerate sets up FSDP on GPUs only; on CPU it would train plain data-parallel (MULTI_CPU), unannounced."""
    config_file = tmp_path / "fsdp.yaml"
    config_file.write_text(README_FSDP_CONFIG)
    done = launch_train(["--config_file", str(config_file)], setup, tmp_path / "run")
    assert done.returncode != 0 and "step 1/" not in done.stdout
    assert done.stderr.count("error: the Accelerate config asks for FSDP but Accelerate set up MULTI_CPU on cpu") == 2
    assert not (tmp_path / "run").exists()  # refused before the output directory is made


@pytest.mark.parametrize(("environ", "distributed", "refused"), [
    ({"ACCELERATE_USE_FSDP": "true"}, "FSDP", None),  # docs/training.md's FSDP config on GPUs
    ({"ACCELERATE_USE_FSDP": "true"}, "MULTI_CPU", "FSDP"),  # the same on CPU
    ({"ACCELERATE_USE_FSDP": "true"}, "NO", "FSDP"),  # one CPU process
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DEEPSPEED", None),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "MULTI_CPU", "DEEPSPEED"),
    ({"ACCELERATE_USE_FSDP": "false"}, "MULTI_CPU", None),  # data parallel, as the two-process test launches it
    ({}, "NO", None),
])
def test_a_sharded_config_accelerate_did_not_set_up_is_refused(environ, distributed, refused):
    if refused is None:
        check_sharding_applied(environ, distributed, torch.device("cpu"))
    else:
        with pytest.raises(UserError, match=f"asks for {refused} but Accelerate set up {distributed} on cpu"):
            check_sharding_applied(environ, distributed, torch.device("cpu"))


def test_a_gathered_state_dict_saves_a_tied_head_once(tmp_path):
    """FSDP's full state dict holds a separate copy under each name of a tied parameter; the model saved from it is
    the one save_pretrained writes from the model itself, without the embedding again as lm_head.weight."""
    model = build_tiny_model("tiny", make_tokenizer(), MICRO_CONFIG, seed=0).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    gathered = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "gathered", state_dict=share_tied_tensors(gathered, model))
    plain, saved = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "gathered" /
                                                                                  "model.safetensors")
    assert saved.keys() == plain.keys() and "lm_head.weight" not in saved
    assert all(torch.equal(saved[name], plain[name]) for name in plain)
    assert share_tied_tensors(None, model) is None  # a process that holds no state dict


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
