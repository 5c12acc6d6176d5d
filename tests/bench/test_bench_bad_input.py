"""`refusion bench` on bad input: one error line, exit 2, and a previous run's files left as they were.

Through the real entry point, in-process (for speed). The output directory holds a previous run
(``results/bench`` is committed measurements), so "nothing written" is checked byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.bench.helpers import error_line, files_in, previous_run, run_bench_cli


@pytest.mark.parametrize("args, message", [
    (["--device", "foo"], "error: unknown device 'foo' (hint: use cpu, cuda, cuda:N or mps)"),
    pytest.param(["--device", "cuda"], "error: device 'cuda' asked for, but this torch has no usable CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    (["--dtype", "int8"], "error: unknown dtype 'int8'; choose one of float32"),
    (["--prompts", "DIR"], "error: the prompts file DIR is a directory, not a JSONL file"),
    (["--prompts", "/dev/null"], "error: the prompts file /dev/null is not a regular file"),
    (["--set", "refusion.slot_threshold=2"], "error: slot_threshold must be in [0, 1], got 2.0"),
    (["--seed", str(2**64)], "error: Invalid value for '--seed': must be a whole number from 0 to 9223372036854775807, "
                             "got 18446744073709551616"),  # torch's generators take no seed past 2**64 - 1
    (["--seed", "-1"], "error: Invalid value for '--seed': must be a whole number from 0 to"),
    (["--threads", "100000"], "error: --threads 100000 is more than this machine's"),  # torch would crash
    (["--device", ""], "error: Invalid value for '--device': the value is empty (leave the option out for the "
                       "default)"),
    (["--model", ""], "error: --model is empty (hint: leave --model out for each decoder's embedded "
                      "model)"),
    (["--model", "=ar-tiny"], "error: --model takes CHECKPOINT or DECODER=CHECKPOINT, got '=ar-tiny' (hint: e.g. --model "
                              "ar=ar-tiny)"),
])
def test_a_bad_option_leaves_the_previous_run_untouched(args, message, tmp_path, monkeypatch, capsys,
                                                        causal_checkpoint):
    output = tmp_path / "out"
    before = previous_run(output)
    args = [str(tmp_path) if arg == "DIR" else arg for arg in args]
    code, out, err = run_bench_cli([*args, "--decoder", "refusion", "ar", "--model", f"refusion={causal_checkpoint}",
                                    f"ar={causal_checkpoint}", "--limit", "1", "--gen-length", "16", "-o", str(output)],
                                   monkeypatch, capsys)
    assert code == 2 and out == ""
    assert error_line(err).startswith(message.replace("DIR", str(tmp_path)))
    assert files_in(output) == before


@pytest.mark.parametrize("args, message", [
    (["--decoder", ",", "--gen-length", "16"], "error: --decoder is empty (hint: leave --decoder out for the default)"),
    (["--decoder", "ar", "--gen-length", ""], "error: --gen-length is empty (hint: leave --gen-length out for the "
                                              "default)"),
    (["--decoder", "ar", "--gen-length", "16", "--preset", "gsm8k"], "error: --preset gsm8k: none of the decoders "
     "given (ar) has a preset of that name (hint: leave --preset out: these decoders have none)"),
    (["--decoder", "ar", "--gen-length", "16", "--causal-fix"], "error: --causal-fix applies to the refusion decoder"),
    (["--decoder", "ar", "--gen-length", "16", "--recheck"], "error: --recheck applies to the refusion decoder"),
    (["--decoder", "ar", "--gen-length", "16", "--output", ""], "error: Invalid value for '--output' / '-o': the path "
     "is empty (use '.' for the working directory)"),
])
def test_an_empty_or_idle_option_is_refused_not_run_with_the_default(args, message, tmp_path, monkeypatch, capsys):
    """An option given nothing, or asking for a row that no decoder makes, would otherwise run the default set
    (every decoder, 256 tokens) or measure without it; an empty --output would be the working directory."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_bench_cli([*args, "--limit", "1", "--warmup", "0"], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert error_line(err).startswith(message)
    assert list(tmp_path.iterdir()) == []  # no results/bench/ nor bench.csv in the working directory


@pytest.mark.parametrize("where, message", [
    ("FILE", "error: --output FILE is a file, not a directory"),
    ("FILE/sub", "error: --output FILE/sub cannot be created: FILE is a file, not a directory"),
    pytest.param("/proc/nope", "error: --output /proc/nope is not writable: cannot create a file in /proc",
                 marks=pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")),
])
def test_an_unusable_output_path_is_one_line_naming_it(where, message, tmp_path, monkeypatch, capsys,
                                                       causal_checkpoint):
    file = tmp_path / "results.txt"
    file.write_text("not a directory")
    output = where.replace("FILE", str(file))
    code, out, err = run_bench_cli(["--decoder", "ar", "--model", f"ar={causal_checkpoint}", "--limit", "1",
                                    "--gen-length", "16", "--output", output], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert error_line(err).startswith(message.replace("FILE", str(file)))
    assert file.read_text() == "not a directory" and sorted(tmp_path.iterdir()) == [file]


def test_a_failure_before_the_first_row_keeps_the_previous_run(tmp_path, monkeypatch, capsys, causal_checkpoint):
    """The model loads, then the decoder refuses it: no row finished, so the output is not touched."""
    output = tmp_path / "out"
    before = previous_run(output)
    code, _, err = run_bench_cli(["--decoder", "llada", "--model", f"llada={causal_checkpoint}", "--limit", "1",
                                  "--gen-length", "16", "--warmup", "0", "-o", str(output)], monkeypatch, capsys)
    assert code == 2
    assert "the llada decoder needs a bidirectional (masked-diffusion) model" in error_line(err)
    assert files_in(output) == before
    code, _, err = run_bench_cli(["--decoder", "llada", "--model", f"llada={causal_checkpoint}", "--limit", "1",
                                  "--gen-length", "16", "--warmup", "0", "-o", str(tmp_path / "new")],
                                 monkeypatch, capsys)
    assert code == 2 and not (tmp_path / "new").exists()


def test_a_model_that_does_not_fit_a_later_decoder_is_refused_before_any_row(tmp_path, monkeypatch, capsys,
                                                                            causal_checkpoint):
    """AR runs first; its row must not be measured (nor the folder replaced) when llada's model cannot work."""
    output = tmp_path / "out"
    before = previous_run(output)
    code, out, err = run_bench_cli(["--decoder", "ar", "llada", "--model", f"ar={causal_checkpoint}",
                                    f"llada={causal_checkpoint}", "--limit", "1", "--gen-length", "16", "-o",
                                    str(output)], monkeypatch, capsys)
    assert code == 2 and "finished row" not in out
    assert "the llada decoder needs a bidirectional (masked-diffusion) model" in error_line(err)
    assert files_in(output) == before


def test_a_new_run_replaces_every_file_of_the_previous_one(tmp_path, monkeypatch, capsys, causal_checkpoint):
    """Prompts without targets draw no frontier plot, one length no length plot: the previous run's must not
    stay behind."""
    output = tmp_path / "out"
    previous_run(output)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n')
    code, _, err = run_bench_cli(["--decoder", "ar", "--model", f"ar={causal_checkpoint}", "--prompts", str(prompts),
                                  "--gen-length", "16", "--warmup", "0", "-o", str(output)], monkeypatch, capsys)
    assert code == 0, err
    assert sorted(path.name for path in output.iterdir()) == ["bench.csv", "bench.md", "machine.json", "run.json",
                                                              "samples.csv"]
    assert (output / "bench.csv").read_text().startswith("decoder,model,gen_length")
    assert "Interrupted" not in (output / "bench.md").read_text()


def test_a_checkpoint_without_a_chat_template_is_one_line_and_keeps_the_previous_run(
        tmp_path, monkeypatch, capsys, causal_checkpoint):
    """Every prompt is rendered as a chat turn: a tokenizer without a template is refused, not a traceback."""
    import shutil

    model = Path(shutil.copytree(causal_checkpoint, tmp_path / "no-template"))
    (model / "chat_template.jinja").unlink()
    output = tmp_path / "out"
    before = previous_run(output)
    code, out, err = run_bench_cli(["--decoder", "ar", "--model", f"ar={model}", "--limit", "1", "--gen-length", "16",
                                    "--warmup", "0", "-o", str(output)], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert error_line(err) == (f"error: the tokenizer of '{model}' has no chat template; prompts are rendered as chat "
                               "turns (hint: use a chat (instruct) checkpoint, or give its tokenizer a chat_template "
                               "(chat_template.jinja))")
    assert files_in(output) == before
