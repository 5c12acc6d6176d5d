"""`refusion train` from the command line: bad input gives one error line and a non-zero exit."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from refusion_cli.models.loading import load_model
from tests.training.training_helpers import (MICRO_CONFIG, arithmetic_records, error_line, run_cli, save_tokenizer,
                                             write_jsonl)


@pytest.fixture
def fresh(tmp_path) -> list[str]:
    """Arguments for a tiny fresh run (data and tokenizer written to tmp_path)."""
    write_jsonl(tmp_path / "data.jsonl", arithmetic_records(8))
    save_tokenizer(tmp_path / "tokenizer")
    return ["train", "--data", str(tmp_path / "data.jsonl"), "--output", str(tmp_path / "run"), "--init", "tiny",
            "--tokenizer", str(tmp_path / "tokenizer"), "--model-config", json.dumps(MICRO_CONFIG),
            "--steps", "2", "--batch-size", "2", "--lr", "1e-3", "--max-length", "48", "--save-every", "1"]


def test_a_tiny_run_trains_reports_skipped_records_and_saves_a_loadable_model(fresh, tmp_path, capsys, monkeypatch):
    records = arithmetic_records(8) + [{"query": "what is one ?", "response": " ".join(["one"] * 60)}]
    write_jsonl(tmp_path / "data.jsonl", records)
    code, out, err = run_cli(fresh, capsys, monkeypatch)
    assert code == 0, err
    assert "skipped 1 record(s) longer than --max-length" in out
    assert "saved checkpoint" in out and "done: 2 steps" in out
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "loss_log.jsonl").read_text().splitlines()] == [
        1, 2]
    loaded = load_model(str(tmp_path / "run"), device="cpu")
    assert loaded.mask_token_id is not None and not loaded.bidirectional


def test_malformed_jsonl_line_is_named_and_no_output_directory_is_left(fresh, tmp_path, capsys, monkeypatch):
    (tmp_path / "data.jsonl").write_text('{"query": "a", "response": "b"}\n{"query": oops}\n')
    code, _, err = run_cli(fresh, capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith(f"error: {tmp_path / 'data.jsonl'}, line 2, is not valid JSON")
    assert not (tmp_path / "run").exists()


def test_empty_dataset_is_an_error_and_only_created_directories_are_removed(fresh, tmp_path, capsys, monkeypatch):
    (tmp_path / "data.jsonl").write_text("")
    code, _, err = run_cli(fresh, capsys, monkeypatch)
    assert code == 2 and error_line(err).startswith(f"error: the data file {tmp_path / 'data.jsonl'} holds no records")
    assert not (tmp_path / "run").exists()
    args = [*fresh]
    args[args.index("--output") + 1] = str(tmp_path / "new" / "nested" / "run")
    assert run_cli(args, capsys, monkeypatch)[0] == 2
    assert not (tmp_path / "new").exists()  # the parents this run made go too
    (tmp_path / "mine").mkdir()
    args[args.index("--output") + 1] = str(tmp_path / "mine")
    assert run_cli(args, capsys, monkeypatch)[0] == 2
    assert (tmp_path / "mine").is_dir()  # the user's own (empty) directory stays


def test_data_directory_is_named_as_a_directory(fresh, tmp_path, capsys, monkeypatch):
    args = [*fresh]
    args[args.index("--data") + 1] = str(tmp_path)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and error_line(err).startswith(f"error: the data path {tmp_path} is a directory, not a JSONL file")
    assert not (tmp_path / "run").exists()


def test_unwritable_output_fails_before_training(fresh, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("")
    args = [*fresh]
    args[args.index("--output") + 1] = str(tmp_path / "a-file" / "run")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith(
        f"error: cannot write checkpoints to '{tmp_path / 'a-file' / 'run'}': Not a directory (hint: choose an")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_fails_before_training(fresh, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    args = [*fresh]
    args[args.index("--output") + 1] = str(locked)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "Permission denied" in error_line(err)


@pytest.mark.parametrize(("extra", "message"), [
    (["--model", "refusion-tiny"], "give either --model (start from a checkpoint) or --init (a fresh model), not both"),
    (["--model-config", '{"hidden_sise": 8}'], "--model-config: unknown Qwen3Config field(s): hidden_sise"),
    (["--model-config", "[1]"], "--model-config must be a JSON object"),
    (["--model-config", '{"eos_token_id": 5}'], "--model-config: eos_token_id come(s) from the tokenizer"),
    (["--grad-accum", "3"], "--batch-size 2 is not divisible by 1 process(es) × 3 accumulation step(s)"),
    (["--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["--seed", "-1"], "--seed must be a non-negative 64-bit integer (got -1)"),
    (["--lr", "nan"], "--lr must be a positive number (got nan)"),
    (["--weight-decay", "nan"], "--weight-decay and --max-grad-norm must be non-negative numbers"),
    (["--model-config", '{"num_hidden_layers": -1}'], "--model-config: num_hidden_layers must be at least 1 (got -1)"),
    (["--model-config", '{"num_attention_heads": 3}'],
     "--model-config: num_attention_heads (3) must be a multiple of num_key_value_heads (2)"),
    (["--model-config", '{"hidden_act": "nope"}'], "--model-config: unknown hidden_act 'nope'"),
    (["--model-config", '{"rms_norm_eps": 0}'], "--model-config: rms_norm_eps must be positive (got 0)"),
    (["--model-config", '{"hidden_size": "wide"}'], "cannot build the 'tiny' model with these --model-config fields: "
                                                    "Field 'hidden_size' expected int, got str"),
    (["--model-config", '{"layer_types": ["full_attention"]}'],
     "cannot build the 'tiny' model with these --model-config fields: `num_hidden_layers` (4) must be equal to"),
    (["--tokenizer", "/nonexistent"], "the tokenizer directory '/nonexistent' does not exist"),
    (["--tokenizer", "{data}"], "--tokenizer '{data}' is a file"),
    (["--tokenizer", "{tmp}"], "'{tmp}' holds no tokenizer (tokenizer.json or tokenizer_config.json)"),
    pytest.param(["--mixed-precision", "fp16"], "fp16 mixed precision needs a GPU; on CPU use --mixed-precision bf16",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on a GPU")),
    (["--resume"], "--resume: '{output}' holds no checkpoint to resume from"),
    (["--eval-data", "{tmp}"], "the eval data path {tmp} is a directory, not a JSONL file (hint: give --eval-data the"),
    (["--eval-data", "{data}", "--eval-every", "0"], "--eval-every must be at least 1 (got 0)"),
    (["--eval-data", "{data}", "--eval-batch-size", "0"], "--eval-batch-size must be at least 1 (got 0)"),
    (["--eval-every", "2"], "--eval-every and --eval-batch-size go with --eval-data (hint: give --eval-data FILE"),
])
def test_bad_options_give_one_error_line(fresh, tmp_path, capsys, monkeypatch, extra, message):
    paths = {"output": tmp_path / "run", "data": tmp_path / "data.jsonl", "tmp": tmp_path}
    extra = [value.format(**paths) if value.startswith("{") and value.endswith("}") and value[1:-1] in paths
             else value for value in extra]
    code, out, err = run_cli([*fresh, *extra], capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith("error: " + message.format(**paths))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("content", "message"), [
    ('{"query": "a", "response": "b"}\n{"query": oops}\n', "{eval}, line 2, is not valid JSON"),
    ('{"query": "a", "response": "b"}\n{"instruction": "a", "output": "b"}\n',
     "{eval}, line 2, has none of the record formats"),
    ("\n", "the eval data file {eval} holds no records"),
    (json.dumps({"query": "what is one ?", "response": " ".join(["one"] * 60)}) + "\n",
     "all 1 records of {eval} are longer than --max-length 48 tokens"),
    (None, "no such eval data file: {eval}"),
])
def test_bad_eval_data_gives_one_error_line_before_training(fresh, tmp_path, capsys, monkeypatch, content, message):
    eval_data = tmp_path / "eval.jsonl"
    if content is not None:
        eval_data.write_text(content)
    code, out, err = run_cli([*fresh, "--eval-data", str(eval_data)], capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith("error: " + message.format(eval=eval_data))
    assert not (tmp_path / "run").exists() and "step 1" not in out  # nothing trained, nothing left behind


def test_eval_data_is_scored_at_step_0_every_n_steps_and_logged(fresh, tmp_path, capsys, monkeypatch):
    eval_data = write_jsonl(tmp_path / "eval.jsonl", arithmetic_records(11)[8:])
    code, out, err = run_cli([*fresh, "--eval-data", str(eval_data)], capsys, monkeypatch)  # --save-every 1
    assert code == 0, err
    assert ("eval data: 3 examples of 3 records, scored at step 0, every step and at step 2, 2 per forward pass "
            "and process") in out
    lines = [line for line in out.splitlines() if line.startswith("eval step ")]
    records = [json.loads(line) for line in (tmp_path / "run" / "eval_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert set(records[0]) == {"step", "loss", "ar_loss", "mdm_loss", "examples", "tokens", "seconds"}
    assert [line.split("  ")[:2] for line in lines] == [[f"eval step {r['step']}/2", f"val loss {r['loss']:.4f} "
                                                         f"(ar {r['ar_loss']:.4f}, mdm {r['mdm_loss']:.4f})"]
                                                        for r in records]
    assert out.index("eval step 1/2") < out.index("saved checkpoint") < out.index("eval step 2/2")


@pytest.mark.parametrize(("first", "again", "message"), [
    (["--eval-data", "{eval}"], ["--eval-data", "{other}"], "cannot resume: the eval data file changed"),
    (["--eval-data", "{eval}"], ["--eval-data", "{eval}", "--eval-every", "2"],
     "cannot resume: eval_every is 2 but the checkpoint was trained with 1 (--eval-every defaults to --save-every)"),
    (["--eval-data", "{eval}"], [], "cannot resume: the run was trained with --eval-data; give the same file"),
    ([], ["--eval-data", "{eval}"], "cannot resume: the run was trained without --eval-data"),
])
def test_resume_needs_the_same_eval_data_and_interval(fresh, tmp_path, capsys, monkeypatch, first, again, message):
    paths = {"eval": write_jsonl(tmp_path / "eval.jsonl", arithmetic_records(11)[8:]),
             "other": write_jsonl(tmp_path / "other.jsonl", arithmetic_records(12)[8:])}
    assert run_cli([*fresh, *(value.format(**paths) for value in first)], capsys, monkeypatch)[0] == 0
    logs = {name: (tmp_path / "run" / name).read_text() for name in ("loss_log.jsonl", "eval_log.jsonl")
            if (tmp_path / "run" / name).exists()}
    args = [*fresh, "--resume", *(value.format(**paths) for value in again)]
    args[args.index("--steps") + 1] = "3"
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith(f"error: {message} (hint: resume with the settings of the interrupted run)")
    assert {name: (tmp_path / "run" / name).read_text() for name in logs} == logs


def test_init_needs_a_tokenizer_and_unknown_options_are_rejected(fresh, capsys, monkeypatch):
    args = [*fresh]
    del args[args.index("--tokenizer"):args.index("--tokenizer") + 2]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith("error: --init needs --tokenizer DIR (the vocabulary of the fresh model)")
    code, _, err = run_cli([*fresh, "--learning-rate", "1"], capsys, monkeypatch)
    assert code == 2 and "No such option: --learning-rate" in err
    code, _, err = run_cli([*fresh, "--objective", "bert"], capsys, monkeypatch)
    assert code == 2 and "'bert' is not one of" in err


def test_existing_run_needs_resume_and_resume_needs_the_same_settings(fresh, tmp_path, capsys, monkeypatch):
    assert run_cli(fresh, capsys, monkeypatch)[0] == 0
    code, _, err = run_cli(fresh, capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith(f"error: '{tmp_path / 'run'}' already holds a training run (hint: pass --resume")
    args = [*fresh, "--resume"]
    args[args.index("--steps") + 1] = "3"
    code, _, err = run_cli([*args, "--seed", "5"], capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith("error: cannot resume: seed is 5 but the checkpoint was trained with 0")
    code, out, err = run_cli(args, capsys, monkeypatch)  # same settings, more steps: continues at step 2
    assert code == 0, err
    assert "resuming" in out and "checkpoint-2 at step 2" in out and "done: 3 steps" in out


def test_resuming_a_finished_run_says_so_and_steps_cannot_go_below_the_checkpoint(fresh, tmp_path, capsys,
                                                                                  monkeypatch):
    assert run_cli(fresh, capsys, monkeypatch)[0] == 0
    log = (tmp_path / "run" / "loss_log.jsonl").read_text()
    code, out, err = run_cli([*fresh, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert out.strip() == (f"nothing to do: the run in {tmp_path / 'run'} is already complete at step 2 "
                           "(the final model is there); raise --steps to train longer")
    assert (tmp_path / "run" / "loss_log.jsonl").read_text() == log
    args = [*fresh, "--resume"]
    args[args.index("--steps") + 1] = "1"
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith("error: cannot resume: the checkpoint is at step 2, past --steps 1")
    args[args.index("--steps") + 1] = "4"
    code, _, err = run_cli([*args, "--stop-at", "2"], capsys, monkeypatch)
    assert code == 2
    assert error_line(err).startswith("error: cannot resume: --stop-at 2 but the run is already at step 2")
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert (tmp_path / "run" / "loss_log.jsonl").read_text() == log


def test_stop_at_says_the_schedule_is_not_over_and_a_log_file_gets_progress_lines(fresh, tmp_path, capsys,
                                                                                  monkeypatch):
    args = [*fresh, "--stop-at", "1"]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "done:" not in out
    assert (f"stopped at step 1 of 2 (--stop-at), " in out and f"the model at this step is in {tmp_path / 'run'}; "
            "continue the schedule with --resume and a later --stop-at, or none" in out)
    # stdout is not a terminal here: one plain line per step (a 2-step schedule), as a cluster job's log shows
    [line] = [line for line in out.splitlines() if line.startswith("step ")]
    assert line.startswith("step 1/2  loss ") and " (ar " in line and " lr " in line and " tok/s " in line
    code, out, err = run_cli([*fresh, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert "done: 2 steps" in out and [line[:8] for line in out.splitlines() if line.startswith("step ")] == [
        "step 2/2"]


def test_sigterm_saves_a_checkpoint_and_exits_143(fresh, tmp_path):
    import signal
    import subprocess
    import time

    args = [*fresh]
    args[args.index("--steps") + 1] = "100000"
    args[args.index("--save-every") + 1] = "100000"
    env = {**os.environ, "COLUMNS": "500"}
    process = subprocess.Popen([sys.executable, "-m", "refusion_cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    log = tmp_path / "run" / "loss_log.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and log.stat().st_size > 0) and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert "stopped at step" in out and "checkpoint saved to" in out and "Traceback" not in err
    assert any((tmp_path / "run").glob("checkpoint-*"))


def test_init_takes_an_embedded_models_tokenizer_by_name(fresh, tmp_path, capsys, monkeypatch):
    args = [*fresh]
    args[args.index("--tokenizer") + 1] = "refusion-tiny"
    args[args.index("--max-length") + 1] = "256"  # the shipped tokenizer has fewer merges for these records
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    loaded = load_model(str(tmp_path / "run"), device="cpu")
    shipped = load_model("refusion-tiny", device="cpu")
    assert loaded.tokenizer.get_vocab() == shipped.tokenizer.get_vocab()
    assert loaded.mask_token_id == shipped.mask_token_id


def test_log_file_progress_lines_end_at_the_runs_last_step_and_count_hours_past_a_day(capsys, tmp_path):
    from pathlib import Path

    from refusion_cli.cli import train as train_cli
    from refusion_cli.training.loop import RunInfo, StepRecord

    view = train_cli.ProgressView()
    assert view.lines  # stdout is captured, not a terminal
    info = RunInfo(objective="ar", start_step=0, total_steps=100, records=8, examples=8, skipped_too_long=0,
                   global_batch=2, micro_batch=2, grad_accum=1, processes=1, parameters=10, device="cpu",
                   mixed_precision="no", output=Path(tmp_path), resumed_from=None, last_step=51)
    view.on_start(info)
    for step in range(1, 52):  # 51 steps of 2,000 s: 28 h 20 min
        view.on_step(StepRecord(step=step, loss=1.0, ar_loss=1.0, mdm_loss=0.0, lr=1e-3, tokens=10, seconds=2000.0,
                                elapsed=2000.0 * step))
    view.progress.stop()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{s}/100" for s in range(2, 51, 2)] + ["51/100"]
    assert lines[-1].endswith(" 28:20:00")


def test_the_progress_shows_the_latest_validation_loss(capsys, tmp_path):
    from pathlib import Path

    from refusion_cli.cli import train as train_cli
    from refusion_cli.training.evaluation import EvalRecord
    from refusion_cli.training.loop import EvalInfo, RunInfo

    view = train_cli.ProgressView()
    info = RunInfo(objective="llada", start_step=0, total_steps=100, records=8, examples=8, skipped_too_long=0,
                   global_batch=2, micro_batch=2, grad_accum=1, processes=1, parameters=10, device="cpu",
                   mixed_precision="no", output=Path(tmp_path), resumed_from=None, last_step=100,
                   evaluation=EvalInfo(records=40, examples=39, skipped_too_long=1, every=25, batch_size=4))
    view.on_start(info)
    assert view.progress.tasks[0].fields["val"] == ""  # nothing scored yet
    view.on_eval(EvalRecord(step=25, loss=2.345678, ar_loss=0.0, mdm_loss=2.345678, examples=39, tokens=1234,
                            seconds=1.5))
    assert view.progress.tasks[0].fields["val"] == ", val 2.3457"
    view.progress.stop()
    out = capsys.readouterr().out
    assert ("eval data: 39 examples of 40 records, scored at step 0, every 25 steps and at step 100, 4 per forward "
            "pass and process") in out
    assert "skipped 1 eval record(s) longer than --max-length" in out
    assert "eval step 25/100  val loss 2.3457 (ar 0.0000, mdm 2.3457)  39 examples, 1,234 tokens, 1.5 s" in out


def test_the_start_lines_are_whole_lines_in_a_log_file(monkeypatch, tmp_path):
    """Off a terminal Rich wraps at 80 columns; a log line cut in two is hard to grep."""
    import io

    from rich.console import Console

    from refusion_cli.cli import train as train_cli
    from refusion_cli.training.loop import RunInfo

    out = io.StringIO()
    monkeypatch.setattr(train_cli, "console", Console(file=out, width=80))
    info = RunInfo(objective="refusion", start_step=0, total_steps=4800, records=50_000, examples=50_000,
                   skipped_too_long=0, global_batch=256, micro_batch=32, grad_accum=1, processes=8,
                   parameters=8_190_735_360, device="cuda:0 (NVIDIA H200)", mixed_precision="bf16", output=tmp_path,
                   resumed_from=None, distributed="MULTI_GPU", last_step=4800)
    view = train_cli.ProgressView()
    view.on_start(info)
    view.progress.stop()
    assert out.getvalue().splitlines()[:2] == [
        "refusion training, fresh run: 8,190,735,360 parameters, 8 process(es) (MULTI_GPU) on cuda:0 (NVIDIA H200), "
        "precision bf16",
        "data: 50,000 examples of 50,000 records; global batch 256 = 8 × 1 × 32"]
