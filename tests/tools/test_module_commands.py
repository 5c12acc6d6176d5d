"""The maintainer scripts beside `refusion` (`python -m tools.overhead`, `python -m tools.build_models`): a bad value
is an argparse usage error naming it (exit 2), checked before any model is built or any data is written."""

from __future__ import annotations

import os

import pytest

from tools.build_models import parse_args as build_args
from tools.batch_headroom import main as headroom_main
from tools.causal_ablations import main as ablations_main
from tools.overhead import main as overhead_main

TINY = ["--gen-length", "8", "--repeats", "1", "--hidden", "32", "--layers", "1"]


def usage_error(run, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run()
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and out.out == "" and "Traceback" not in out.err
    return out.err.splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--threads", "-1"], "--threads must be from 1 to this machine's"),  # torch raised a RuntimeError
    (["--threads", "0"], "--threads must be from 1 to this machine's"),  # was silently the default
    (["--threads", str(10 * (os.cpu_count() or 1))], "--threads must be from 1 to this machine's"),
    (["--hidden", "30"], "--hidden must be a multiple of 8 (4 heads of an even size), got 30"),  # a RoPE traceback
    (["--gen-length", "5000"], "--gen-length must be at most 2000 (the model's 2048 positions less the 48-token "
                               "prompt), got 5000"),  # a UserError traceback after the model was built
])
def test_overhead_refuses_impossible_settings(args, message, capsys):
    assert message in usage_error(lambda: overhead_main([*TINY, *args]), capsys)


@pytest.mark.parametrize("args, message", [
    (["--n-train", "-1"], "--n-train must be at least 1, got -1"),  # a ValueError traceback
    (["--base-steps", "0"], "--base-steps must be at least 1, got 0"),  # failed in the training subprocess
    (["--finetune-batch-size", "-2"], "--finetune-batch-size must be at least 0, got -2"),
    (["--base-lr", "nan"], "--base-lr must be a positive number, got nan"),
    (["--finetune-lr", "-1"], "--finetune-lr must be a positive number, got -1.0"),
    (["--base-steps", "10", "--base-stop-at", "20"], "--base-stop-at (20) is past the end of --base-steps (10)"),
    (["--model-config", "{oops"], "--model-config is not valid JSON: Expecting property name enclosed in double "
                                  "quotes (column 2)"),
    (["--model-config", "[1]"], "--model-config must be a JSON object of Qwen3Config fields"),
    (["--only", "ar-tiny", "gpt-tiny"], "--only: unknown model(s) gpt-tiny; choose from ar-tiny, mdm-tiny, "
                                        "refusion-tiny, dream-tiny"),  # ran nothing, then wrote the model card
    (["--only", "dream-tiny"], "--only: dream-tiny starts from ar-tiny; add ar-tiny"),
    (["--dream-stage", "10", "0", "1e-3", "0.1"], "--dream-stage 10 0 1e-3 0.1: steps and batch must be at least 1, "
                                                  "lr a positive number and warmup from 0 to below 1"),
    (["--dream-stage", "10", "64", "1e-3", "1"], "--dream-stage 10 64 1e-3 1: steps and batch must be at least 1"),
    (["--dream-stage", "10", "a", "1e-3", "0.1"], "--dream-stage 10 a 1e-3 0.1: expected STEPS BATCH LR WARMUP"),
])
def test_build_refuses_impossible_settings_before_building_anything(args, message, tmp_path, capsys):
    assert message in usage_error(lambda: build_args(["--work", str(tmp_path / "work"), *args]), capsys)
    assert not (tmp_path / "work").exists()


def test_build_refuses_a_work_folder_that_is_a_file(tmp_path, capsys):
    work = tmp_path / "work"
    work.write_text("keep")
    assert f"--work {work} is a file, not a directory" in usage_error(lambda: build_args(["--work", str(work)]),
                                                                        capsys)
    assert work.read_text() == "keep"


@pytest.mark.parametrize("args, message", [
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--repeats", "-1"], "--repeats must be at least 1, got -1"),
    (["--decodes", "0"], "--decodes must be at least 1, got 0"),
    (["--threads", "0"], "--threads must be from 1 to this machine's"),
])
def test_batch_headroom_refuses_impossible_settings(args, message, capsys):
    assert message in usage_error(lambda: headroom_main(args), capsys)


def test_batch_headroom_counts_the_fed_tokens_of_batch_1(capsys):
    headroom_main(["--decoder", "ar", "--limit", "2", "--gen-length", "4", "--repeats", "1", "--decodes", "1",
                   "--threads", "1"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| ar |")).split(" | ")
    calls, fed = int(row[3]), int(row[4])
    # AR: one call per token; the first call of each prompt feeds the whole prompt, the next three one token
    assert calls == 2 * 4 and fed == 2 * 3 + sum(prompt_lengths(2))
    assert row[-1].endswith("× |") and "| 16 |" in out


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be from 1 to this machine's"),
    (["--threads", str(10 * (os.cpu_count() or 1))], "--threads must be from 1 to this machine's"),
])
def test_causal_ablations_refuses_impossible_thread_counts(args, message, capsys):
    assert message in usage_error(lambda: ablations_main(["--limit", "1", *args]), capsys)


def test_causal_ablations_names_a_missing_checkpoint(tmp_path, capsys):
    missing = tmp_path / "no-model"
    assert f"no such checkpoint directory: '{missing}'" in usage_error(
        lambda: ablations_main(["--limit", "1", "--model", str(missing)]), capsys)


def prompt_lengths(limit: int) -> list[int]:
    """Token counts of the first ``limit`` synthetic prompts in ar-tiny's chat template."""
    from refusion_cli.bench.prompts import load_prompts
    from refusion_cli.models.chat import user_prompt_ids
    from refusion_cli.models.loading import load_model
    tokenizer = load_model("ar-tiny", device="cpu", require_mask=False).tokenizer
    return [len(user_prompt_ids(tokenizer, prompt.text)) for prompt in load_prompts(limit=limit)]
