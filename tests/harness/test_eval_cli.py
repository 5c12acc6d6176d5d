"""`refusion eval` end to end on tiny random checkpoints: files, counts, agreement with direct decoding,
resume after a kill, data parallelism, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refusion_cli.decoding.spec import preset_config
from refusion_cli.decoding.registry import build_config
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.errors import UserError
from refusion_cli.harness.suite import EVALS_DIR, load_suite
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import is_correct, read_jsonl
from tests.envs import cache_env
from tests.harness.helpers import run_cli
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PROBLEMS = read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")


def cli_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "200",
            "HOME": os.environ.get("HOME", "/tmp"), **cache_env()}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def one_journal(run_dir: Path, decoder: str) -> Path:
    [path] = (run_dir / "samples" / "synthetic").glob(f"{decoder}__*.jsonl")
    return path


def direct_outputs(checkpoint: Path, decoder: str, config, n: int) -> list[str]:
    """Decode the first n synthetic problems without lm-eval: chat prompt, decoder, seed 0."""
    loaded = load_model(str(checkpoint), "cpu", require_mask=False)
    texts = []
    for problem in PROBLEMS[:n]:
        result = run_decoder(decoder, loaded.model, user_prompt_ids(loaded.tokenizer, problem["question"]), config,
                             mask_token_id=loaded.mask_token_id, eos_token_id=loaded.eos_token_id,
                             generator=torch.Generator().manual_seed(0))
        texts.append(loaded.tokenizer.decode(result.tokens, skip_special_tokens=True))
    return texts


def test_synthetic_run_writes_every_file_and_matches_direct_decoding(causal_checkpoint, tmp_path, capsys,
                                                                      monkeypatch):
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, monkeypatch, "--task", "synthetic", "--decoder", "refusion", "ar", "--model",
                             str(causal_checkpoint), "--limit", "5", "--set", "gen_length=48", "--output", str(run_dir))
    assert code == 0, err
    assert "accuracy (%) / TPS" in out and "TPF" in out
    metrics = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert [m["decoder"] for m in metrics] == ["refusion", "ar"]
    configs = {"refusion": build_config("refusion", {"gen_length": 48}, base=preset_config("synthetic_tiny")),
               "ar": build_config("ar", {"gen_length": 48})}
    for metric in metrics:
        decoder = metric["decoder"]
        lines = records(one_journal(run_dir, decoder))
        assert len(lines) == metric["samples"] == 5 and sorted(r["doc_id"] for r in lines) == list(range(5))
        for line in lines:
            assert {"prompt", "output", "target", "correct", "tokens", "seconds", "forwards", "tps"} <= set(line)
        expected = direct_outputs(causal_checkpoint, decoder, configs[decoder], 5)
        assert [r["output"] for r in sorted(lines, key=lambda r: r["doc_id"])] == expected
        correct = [is_correct(text, problem["target"]) for text, problem in zip(expected, PROBLEMS)]
        assert [r["correct"] for r in sorted(lines, key=lambda r: r["doc_id"])] == correct
        assert metric["accuracy"] == pytest.approx(100 * sum(correct) / 5)
        assert metric["lm_eval_accuracy"] == pytest.approx(metric["accuracy"])  # lm-eval's own aggregate agrees
        assert metric["config"] == configs[decoder].__dict__
        assert metric["tokens"] == sum(r["tokens"] for r in lines) and metric["tps"] > 0
        # TPS as the paper counts it: all tokens over all decode seconds; the per-sample mean is kept beside it
        # (rel=1e-12: only the order of the float sums may differ)
        assert metric["tps"] == pytest.approx(metric["tokens"] / sum(r["seconds"] for r in lines), rel=1e-12)
        assert metric["tps_sample_mean"] == pytest.approx(sum(r["tps"] for r in lines) / 5, rel=1e-12)
    table = (run_dir / "summary.md").read_text()
    assert "| decoder:model | Synthetic |" in table and f"refusion:{causal_checkpoint.name}" in table
    header, *lines = (run_dir / "summary.csv").read_text().splitlines()
    assert header.startswith("task,protocol,decoder,model,label,settings,seed,samples,accuracy,")
    assert [line.split(",")[:3] for line in lines] == [["synthetic", "", "refusion"], ["synthetic", "", "ar"]]


class CountingObserver:
    def __init__(self) -> None:
        self.decoded = 0
        self.stored = 0
        self.other_settings = 0

    def on_run_start(self, benchmark, label, config) -> None: ...

    def on_requests(self, total: int, stored: int, other_settings: int) -> None:
        self.stored += stored
        self.other_settings = other_settings

    def on_sample(self, record) -> None:
        self.decoded += 1

    def on_run_end(self, result) -> None: ...


def eval_options(checkpoint: Path, output: Path, limit: int, **changes):
    from refusion_cli.harness.runner import EvalOptions

    settings = dict(tasks=["synthetic"], decoders=["ar"], output=output, models=[str(checkpoint)], limit=limit,
                    device="cpu")
    return EvalOptions(**{**settings, **changes})


@pytest.mark.slow  # `make test-all` (20 s): by default the in-process interruption test below and the torn-line
# tests of the journal check the same resume
def test_a_killed_run_resumes_without_decoding_any_sample_twice(causal_checkpoint, tmp_path):
    from refusion_cli.harness.runner import run_eval

    limit, run_dir = 12, tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "refusion_cli", "eval", "--task", "synthetic", "--decoder", "ar", "--model",
         str(causal_checkpoint), "--limit", str(limit), "--set", "gen_length=96", "--device", "cpu",
         "--output", str(run_dir)],
        env=cli_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    journal = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            found = list((run_dir / "samples" / "synthetic").glob("ar__*.jsonl"))
            if found and found[0].read_bytes().count(b"\n") >= 3:
                journal = found[0]
                break
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the process group this test started
        process.wait()
    assert journal is not None, "the run ended before any sample was journaled"
    before = journal.read_bytes()
    finished_before = before.count(b"\n")  # a torn last line is not a finished sample
    assert 3 <= finished_before < limit, "the kill came too late to test resuming"

    observer = CountingObserver()
    [resumed] = run_eval(eval_options(causal_checkpoint, run_dir, limit, overrides=["gen_length=96"]), observer)
    assert observer.stored == finished_before and observer.decoded == limit - finished_before
    after = journal.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1])  # nothing written before is lost or rewritten
    lines = records(journal)
    assert len(lines) == limit and len({r["key"] for r in lines}) == limit  # no sample decoded twice
    assert resumed.resumed == finished_before and resumed.decoded == limit - finished_before

    [fresh] = run_eval(eval_options(causal_checkpoint, tmp_path / "fresh", limit, overrides=["gen_length=96"]))
    fresh_lines = {r["doc_id"]: r for r in records(one_journal(tmp_path / "fresh", "ar"))}
    for line in lines:
        assert line["output"] == fresh_lines[line["doc_id"]]["output"]
        assert line["tokens"] == fresh_lines[line["doc_id"]]["tokens"]
    assert (resumed.samples, resumed.accuracy, resumed.tokens, resumed.forwards) == \
        (fresh.samples, fresh.accuracy, fresh.tokens, fresh.forwards)


def test_a_run_interrupted_in_process_resumes_from_its_journal(causal_checkpoint, tmp_path):
    from refusion_cli.harness.runner import run_eval

    class StopAfter(CountingObserver):
        def on_sample(self, record) -> None:
            super().on_sample(record)
            if self.decoded == 2:
                raise KeyboardInterrupt

    options = eval_options(causal_checkpoint, tmp_path / "run", 5, decoders=["refusion"], overrides=["gen_length=32"])
    with pytest.raises(KeyboardInterrupt):
        run_eval(options, StopAfter())
    observer = CountingObserver()
    [result] = run_eval(options, observer)
    assert (observer.stored, observer.decoded, result.samples, result.resumed) == (2, 3, 5, 2)
    assert len(records(one_journal(tmp_path / "run", "refusion"))) == 5
    again = CountingObserver()
    run_eval(options, again)
    assert (again.stored, again.decoded) == (5, 0)
    other_dtype = CountingObserver()  # so is another dtype: its tokens and timings differ
    shutil.copytree(tmp_path / "run", tmp_path / "bf16")
    [bf16] = run_eval(eval_options(causal_checkpoint, tmp_path / "bf16", 5, decoders=["refusion"],
                                   overrides=["gen_length=32"], dtype="bfloat16"), other_dtype)
    assert (other_dtype.stored, other_dtype.decoded, other_dtype.other_settings) == (0, 5, 5)
    assert (result.device, result.dtype, bf16.device, bf16.dtype) == ("cpu", "float32", "cpu", "bfloat16")
    changed = eval_options(causal_checkpoint, tmp_path / "run", 5, decoders=["refusion"],
                           overrides=["gen_length=32", "slot_threshold=0.5"])
    with pytest.raises(UserError, match="holds refusion:.* on synthetic with other settings .slot_threshold 0.9 "
                                        "there, 0.5 here."):
        run_eval(changed)  # another decoder setting in the same folder: refused, never mixed into the row
    [cell] = json.loads((tmp_path / "run" / "metrics.json").read_text())["results"]
    assert cell["config_hash"] == result.config_hash and len(records(one_journal(tmp_path / "run", "refusion"))) == 5


def test_runs_into_one_folder_add_up_side_by_side(causal_checkpoint, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    common = ("--task", "synthetic", "--model", str(causal_checkpoint), "--limit", "2", "--set", "gen_length=16",
              "--output", str(run_dir))
    code, _, stderr = run_cli(capsys, monkeypatch, "--decoder", "ar", *common)
    assert code == 0, stderr
    code, second, stderr = run_cli(capsys, monkeypatch, "--decoder", "refusion", *common)
    assert code == 0, stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert [(m["decoder"], m["samples"]) for m in metrics] == [("ar", 2), ("refusion", 2)]
    name = causal_checkpoint.name
    table = (run_dir / "summary.md").read_text()
    assert f"| ar:{name} |" in table and f"| refusion:{name} |" in table
    assert f"ar:{name}" in second and "1 cell(s) above come from earlier runs into this folder" in second
    code, again, stderr = run_cli(capsys, monkeypatch, "--decoder", "ar", *common)  # resumes, keeps the other cell
    assert code == 0, stderr
    assert [m["decoder"] for m in json.loads((run_dir / "metrics.json").read_text())["results"]] == ["ar", "refusion"]
    assert "2 sample(s) were read back from earlier runs" in again


def test_a_decoder_given_two_checkpoints_runs_on_each_one_model_in_memory_at_a_time(causal_checkpoint, tmp_path,
                                                                                     monkeypatch):
    """Table 1 has two AR rows: ``--model ar=A --model ar=B`` runs the decoder on each, and the first model is let
    go before the second loads (nine 8B checkpoints need not fit in memory together)."""
    import gc
    import weakref

    from refusion_cli.harness.runner import EvalOptions, run_eval
    from refusion_cli.models import loading

    earlier: list[weakref.ref] = []
    alive_at_load: list[list[bool]] = []
    load = loading.load_model

    def load_and_watch(*args, **kwargs):
        gc.collect()
        alive_at_load.append([ref() is not None for ref in earlier])
        loaded = load(*args, **kwargs)
        earlier.append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(loading, "load_model", load_and_watch)
    results = run_eval(EvalOptions(tasks=["synthetic"], decoders=["ar", "refusion"], output=tmp_path / "run",
                                   models=[f"ar={causal_checkpoint}", "ar=ar-tiny", f"refusion={causal_checkpoint}"],
                                   overrides=["gen_length=8"], limit=1, device="cpu"))
    name = causal_checkpoint.name
    assert [result.label for result in results] == [f"ar:{name}", f"refusion:{name}", "ar:ar-tiny"]
    assert alive_at_load == [[], [False]]  # two models, each loaded once, the first gone before the second


def config_opens(folder: Path) -> tuple[list[str], list[bool]]:
    """Watch the opens of ``folder``'s config.json (an audit hook; hooks stay for the process, so this one records
    only while the returned switch holds True): each open is recorded as "toolkit" when the first frame above
    the standard library that opened it is the toolkit's, else as "library" (transformers, huggingface_hub)."""
    import sysconfig

    target, stdlib = str(folder / "config.json"), sysconfig.get_paths()["stdlib"]
    opened: list[str] = []
    switch = [True]

    def hook(event: str, args: tuple) -> None:
        if not (switch and event == "open" and isinstance(args[0], (str, os.PathLike))
                and os.fspath(args[0]) == target):
            return
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(stdlib):
            frame = frame.f_back
        opened.append("toolkit" if frame is not None and "refusion_cli" in frame.f_code.co_filename else "library")

    sys.addaudithook(hook)
    return opened, switch


def test_one_eval_reads_a_folder_models_config_once(causal_checkpoint, tmp_path):
    """Planning resolves each distinct --model once and loading reads that record: two decoders on one folder
    open its config.json once in the toolkit (before the record: six times), at most three times in all."""
    from refusion_cli.harness.runner import EvalOptions, run_eval

    opened, switch = config_opens(causal_checkpoint)
    try:
        results = run_eval(EvalOptions(tasks=["synthetic"], decoders=["ar", "refusion"], output=tmp_path / "run",
                                       models=[str(causal_checkpoint)], overrides=["gen_length=8"], limit=1,
                                       device="cpu"))
    finally:
        switch.clear()
    assert [result.decoder for result in results] == ["ar", "refusion"]
    assert opened.count("toolkit") == 1 and len(opened) <= 3, opened


def test_the_journal_drops_a_torn_line_and_reads_every_process_file(tmp_path):
    from refusion_cli.harness.journal import SampleJournal, journal_path

    directory = tmp_path / "samples"
    directory.mkdir()
    line = lambda key, digest="c": json.dumps({"key": key, "config_hash": digest, "output": key}) + "\n"  # noqa: E731
    own = journal_path(directory, "ar__m")
    own.write_text(line("k0") + line("k1") + line("old", digest="other") + '{"key": "k2", "conf')  # killed mid-write
    journal_path(directory, "ar__m", rank=1).write_text(line("k3"))
    (directory / "ar__m2.jsonl").write_text(line("x"))  # another label
    journal = SampleJournal(directory, benchmark="synthetic", decoder="ar", model="m", label="ar__m",
                            config_hash="c", scorer=lambda *args: None)
    assert set(journal.stored) == {"k0", "k1", "k3"}  # other config hashes and labels are not reused
    assert own.read_text() == line("k0") + line("k1") + line("old", digest="other")


def test_another_process_file_torn_inside_a_character_is_read_up_to_its_last_whole_line(tmp_path):
    """A process killed while writing a non-ASCII output leaves half a UTF-8 character; resuming must not fail on it."""
    from refusion_cli.harness.journal import SampleJournal, journal_path

    directory = tmp_path / "samples"
    directory.mkdir()
    whole = json.dumps({"key": "k0", "config_hash": "c", "output": "5 €"}, ensure_ascii=False) + "\n"
    torn = json.dumps({"key": "k1", "config_hash": "c", "output": "7 €"}, ensure_ascii=False).encode()[:-4]
    journal_path(directory, "ar__m", rank=1).write_bytes(whole.encode() + torn)  # ends inside the "€"
    journal = SampleJournal(directory, benchmark="synthetic", decoder="ar", model="m", label="ar__m",
                            config_hash="c", scorer=lambda *args: None)
    assert set(journal.stored) == {"k0"} and journal.stored["k0"]["output"] == "5 €"


@pytest.mark.slow  # 14 s: two processes under accelerate launch; make test-all runs it
@pytest.mark.skipif(shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None,
                    reason="accelerate's launcher is not installed")
def test_two_process_data_parallel_run_equals_one_process(causal_checkpoint, tmp_path):
    from refusion_cli.harness.runner import run_eval

    args = ["--task", "synthetic", "--decoder", "ar", "--model", str(causal_checkpoint), "--limit", "5",
            "--set", "gen_length=32", "--device", "cpu"]
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                "--main_process_port", str(free_port()), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "refusion_cli", "eval"]
    out = subprocess.run([*launcher, *args, "--output", str(tmp_path / "dp")], capture_output=True, text=True,
                         env=cli_env(), cwd=REPO, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    shards = sorted((tmp_path / "dp" / "samples" / "synthetic").glob("ar__*.jsonl"))
    assert len(shards) == 2  # each process journaled its own share
    parallel = {r["doc_id"]: r for shard in shards for r in records(shard)}
    [single] = run_eval(eval_options(causal_checkpoint, tmp_path / "single", 5, overrides=["gen_length=32"]))
    alone = {r["doc_id"]: r for r in records(one_journal(tmp_path / "single", "ar"))}
    assert sorted(parallel) == sorted(alone) == list(range(5))
    assert all(parallel[i]["output"] == alone[i]["output"] and parallel[i]["tokens"] == alone[i]["tokens"]
               for i in alone)
    [merged] = json.loads((tmp_path / "dp" / "metrics.json").read_text())["results"]
    assert (merged["samples"], merged["accuracy"], merged["tokens"], merged["forwards"]) == \
        (single.samples, single.accuracy, single.tokens, single.forwards)


def test_models_default_to_the_embedded_ones_and_take_per_decoder_overrides():
    from refusion_cli.decoding.spec import parse_decoder_options
    from refusion_cli.decoding.spec import parse_overrides as decoder_overrides
    from refusion_cli.harness.runner import decoder_runs as runs_of

    def decoder_runs(decoders, models):
        return runs_of(parse_decoder_options(decoders, models))

    runs = decoder_runs(["refusion", "ar", "llada", "ar"], [])
    assert [(r.decoder, r.model, r.label) for r in runs] == [
        ("refusion", "refusion-tiny", "refusion:refusion-tiny"), ("ar", "ar-tiny", "ar:ar-tiny"),
        ("llada", "mdm-tiny", "llada:mdm-tiny")]
    runs = decoder_runs(["refusion", "ar"], ["/ckpt/shared", "ar=/ckpt/qwen3"])
    assert [(r.model, r.label, r.file_label) for r in runs] == [
        ("/ckpt/shared", "refusion:shared", "refusion__shared"), ("/ckpt/qwen3", "ar:qwen3", "ar__qwen3")]
    runs = decoder_runs(["refusion"], ["runs/refusion-tiny/"])  # a folder named like a shipped model
    assert [(r.model, r.label) for r in runs] == [("runs/refusion-tiny/", "refusion:runs/refusion-tiny")]
    assert decoder_overrides(["gen_length=64", "refusion.slot_size=4", "steps=16"], ["refusion", "ar", "llada"]) == {
        "refusion": {"gen_length": "64", "slot_size": "4"}, "ar": {"gen_length": "64"},
        "llada": {"gen_length": "64", "steps": "16"}}
    # a decoder's own value wins over the plain one, in either order
    for order in (["gen_length=64", "ar.gen_length=32"], ["ar.gen_length=32", "gen_length=64"]):
        assert decoder_overrides(order, ["refusion", "ar"]) == {"refusion": {"gen_length": "64"},
                                                                "ar": {"gen_length": "32"}}


# --- one-line errors -------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--task", "gsm9k"], "unknown task 'gsm9k'"),
    (["--task", "synthetic", "--decoder", "refusion", "--decoder", "rnn"], "unknown decoder 'rnn'"),
    (["--task", "synthetic", "--decoder", "ar", "--set", "slot_size=8"], "no selected decoder has an option 'slot_size'"),
    (["--task", "synthetic", "--set", "slot_sise=8"], "no selected decoder has an option 'slot_sise'"),
    (["--task", "synthetic", "--set", "token_threshold=1.5"], "token_threshold must be in [0, 1]"),
    (["--task", "synthetic", "--decoder", "ar", "--set", "refusion.slot_size=8"], "'refusion' is not a selected decoder"),
    (["--task", "synthetic", "--preset", "nope"], "--preset nope: none of the decoders given (refusion) has a preset "
     "of that name (hint: presets: refusion: mmlu_pro, "),
    (["--task", "synthetic", "--decoder", "ar", "--preset", "gsm8k"], "--preset gsm8k: none of the decoders given (ar) "
     "has a preset of that name (hint: leave --preset out: these decoders have none)"),
    (["--task", "synthetic", "--decoder", "ar", "--recheck"],
     "--recheck applies to the refusion decoder, which is not among the decoders given (ar)"),
    (["--task", "humaneval", "--decoder", "ar"], "--confirm-run-unsafe-code"),
    (["--task", "synthetic", "--decoder", "ar", "--model", "/no/such/checkpoint"], "no such checkpoint directory"),
    (["--task", "synthetic", "--decoder", "dream"], "the dream decoder has no embedded model"),
    (["--task", "synthetic", "--decoder", "ar", "llada", "--model", "CAUSAL"],  # found before AR decodes anything
     "the llada decoder needs a bidirectional (masked-diffusion) model"),
    # an empty or repeated value is refused, never replaced by a default or by the last one given
    (["--task", "synthetic", "--decoder", "ar", "--model", ""], "--model is empty"),
    (["--task", "synthetic", "--decoder", "ar", "--model", "ar="], "--model ar=: no checkpoint after '='"),
    (["--task", "synthetic", "--decoder", "ar", "--model", "CAUSAL", "--model", "ar-tiny"],
     "--model gives every decoder two checkpoints: CAUSAL and ar-tiny"),
    (["--task", "synthetic", "--decoder", "ar", "--set", "gen_length=8", "--set", "gen_length=9"],
     "--set gives gen_length two values: 8 and 9"),
    (["--task", "synthetic", "--decoder", "ar", "--set", "ar.gen_length=8", "--set", "ar.gen_length=9"],
     "--set gives ar.gen_length two values: 8 and 9"),
    (["--task", "synthetic", "--set", "gen_length=", "--decoder", "ar"], "--set gen_length=: no value after '='"),
    (["--task", "synthetic", "--set", "refusion.=1"],
     "--set takes KEY=VALUE or DECODER.KEY=VALUE, got 'refusion.=1'"),
    (["--task", "synthetic", "--decoder", "ar", "--data-file", "synthetic="],
     "--data-file synthetic=: no value after '='"),
    (["--task", "synthetic", "--decoder", "ar", "--data-file", "synthetic=a.jsonl",
      "--data-file", "synthetic=b.jsonl"], "--data-file gives synthetic two files: a.jsonl and b.jsonl"),
    (["--task", "synthetic", "--decoder", "ar", "--device", ""],
     "Invalid value for '--device': the value is empty"),
    (["--task", "synthetic", "--decoder", "ar", "--seed", str(2**64)],
     "Invalid value for '--seed': must be a whole number from 0 to 9223372036854775807, got 18446744073709551616"),
    # lm-eval slices the documents with islice, which takes no stop past sys.maxsize
    (["--task", "synthetic", "--decoder", "ar", "--limit", "-1"],
     "--limit must be a number of documents (0: check the data and tasks only), got -1"),
    (["--task", "synthetic", "--decoder", "ar", "--limit", "99999999999999999999"],
     "--limit 99999999999999999999 is larger than any benchmark (hint: leave --limit out to run every document)"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, causal_checkpoint, capsys, monkeypatch, tmp_path):
    if "--model" not in args and "dream" not in args:
        args = [*args, "--model", str(causal_checkpoint)]
    if "--limit" not in args:
        args = [*args, "--limit", "1"]  # were a mistake let through, the run stays short
    args = [arg.replace("CAUSAL", str(causal_checkpoint)) for arg in args]
    code, stdout, stderr = run_cli(capsys, monkeypatch, *args, "--output", str(tmp_path / "run"))
    assert code == 2 and message.replace("CAUSAL", str(causal_checkpoint)) in stderr
    assert stderr.count("error:") == 1 and "Traceback" not in stderr and stdout == ""
    assert not (tmp_path / "run").exists()  # nothing is written for a run that cannot start


def test_a_benchmark_without_offline_data_says_which_file_it_needs(causal_checkpoint, capsys, monkeypatch, tmp_path):
    start = time.monotonic()
    (tmp_path / "nothing").mkdir()
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gsm8k", "--decoder", "ar", "--model",
                                   str(causal_checkpoint), "--data-dir", str(tmp_path / "nothing"),
                                   "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and "Traceback" not in stderr
    squeezed = "".join(stderr.split())  # Rich may fold a long path across lines
    assert f"{tmp_path / 'nothing' / 'gsm8k' / 'test.jsonl'}ismissing" in squeezed and "openai/gsm8k" in stderr
    assert "(hint: add --download to fetch it from the hub, or put openai/gsm8k, config main, split test" in stderr
    assert time.monotonic() - start < 30 and not (tmp_path / "run").exists()


def test_a_checkpoint_without_a_chat_template_is_one_line_and_writes_nothing(causal_checkpoint, capsys, monkeypatch,
                                                                             tmp_path):
    """Every benchmark prompt goes through the chat template: a tokenizer without one is refused, not a traceback."""
    import shutil

    model = Path(shutil.copytree(causal_checkpoint, tmp_path / "no-template"))
    (model / "chat_template.jinja").unlink()
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "synthetic", "--decoder", "ar", "--model", str(model),
                                   "--limit", "1", "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and "Traceback" not in stderr
    assert " ".join(stderr.split()) == (f"error: the tokenizer of '{model}' has no chat template; prompts are rendered "
                                        "as chat turns (hint: use a chat (instruct) checkpoint, or give its tokenizer "
                                        "a chat_template (chat_template.jinja))")
    assert not (tmp_path / "run").exists()


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("case", ["device", "cuda", "dtype", "model", "no_data_dir", "unused_data_dir", "empty_file",
                                  "bad_json", "not_object", "no_file"])
def test_bad_options_and_data_files_stop_before_the_output_folder_exists(case, capsys, monkeypatch, tmp_path):
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    good = '{"question": "What is 1 + 1?", "target": "2"}'
    args, words = {
        "device": (["--device", "foo"], ["unknown device 'foo'"]),
        "cuda": (["--device", "cuda"], ["device 'cuda'", "no usable CUDA device"]),
        "dtype": (["--dtype", "float8"], ["unknown dtype 'float8'"]),
        "model": (["--model", "foo=ar-tiny"], ["'foo' is not a decoder", "refusion, ar, llada, dream"]),
        "no_data_dir": (["--data-dir", str(tmp_path / "absent")], [f"--data-dir {tmp_path / 'absent'} does not exist"]),
        "unused_data_dir": (["--data-dir", str(tmp_path)], ["has no effect", "(synthetic)"]),
        "empty_file": (["--data-file", f"synthetic={write_lines(tmp_path / 'empty.jsonl')}"],
                       [f"{tmp_path / 'empty.jsonl'} is empty"]),
        "bad_json": (["--data-file", f"synthetic={write_lines(tmp_path / 'bad.jsonl', good, '{oops}')}"],
                     [f"{tmp_path / 'bad.jsonl'}, line 2, is not valid JSON"]),
        "not_object": (["--data-file", f"synthetic={write_lines(tmp_path / 'list.jsonl', '', good, '[1, 2]')}"],
                       [f"{tmp_path / 'list.jsonl'}, line 3, is not a JSON object"]),
        "no_file": (["--data-file", f"synthetic={tmp_path / 'absent.jsonl'}"],
                    [f"--data-file {tmp_path / 'absent.jsonl'} does not exist", "check the path"]),
    }[case]
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "synthetic", "--limit", "1", *args,
                                   "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and stderr.startswith("error: ") and stderr.count("error:") == 1
    assert all(word in stderr for word in words) and "Traceback" not in stderr and "pyarrow" not in stderr
    assert "put evals/synthetic" not in stderr  # the missing-data hint is for default locations only
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["file", "below_a_file", "unwritable"])
def test_an_unusable_output_path_is_one_line_naming_it(case, capsys, monkeypatch, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    output = {"file": a_file, "below_a_file": a_file / "sub", "unwritable": Path("/proc/nope")}[case]
    if case == "unwritable" and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "synthetic", "--limit", "1", "--device", "cpu",
                                   "--output", str(output))
    assert code == 2 and stdout == "" and stderr.count("error:") == 1 and "Traceback" not in stderr
    assert str(output) in stderr
    assert a_file.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [a_file]
    assert not Path("/proc/nope").exists()


@pytest.mark.parametrize("option, name", [("--output", "'--output' / '-o'"), ("--data-dir", "'--data-dir'")])
def test_an_empty_path_is_refused_not_read_as_the_working_directory(option, name, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # Path("") is "."
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "synthetic", "--decoder", "ar", "--limit", "1",
                                   "--device", "cpu", *([] if option == "--output" else ["--output", "run"]),
                                   option, "")
    assert code == 2 and stdout == "" and "Traceback" not in stderr
    assert stderr == (f"error: Invalid value for {name}: the path is empty (use '.' for the working directory) "
                      "(hint: refusion eval --help lists the options)")
    assert list(tmp_path.iterdir()) == []  # no metrics.json, samples/ or eval.log in the working directory


def test_a_run_that_fails_before_its_first_sample_removes_only_a_folder_it_created(capsys, monkeypatch, tmp_path):
    from refusion_cli.harness.journal import journal_path

    no_fields = write_lines(tmp_path / "no_fields.jsonl", '{"q": 1}', '{"q": 2}')  # valid JSON, fails in lm-eval
    args = ["--task", "synthetic", "--decoder", "ar", "--limit", "1", "--device", "cpu",
            "--data-file", f"synthetic={no_fields}"]
    code, _, stderr = run_cli(capsys, monkeypatch, *args, "--output", str(tmp_path / "new"))
    assert code == 2 and "lm-eval could not build the task" in stderr and str(no_fields) in stderr
    assert not (tmp_path / "new").exists()  # no eval.log, no tasks/ left behind

    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, monkeypatch, *args, "--output", str(empty))[0] == 2
    assert empty.is_dir()  # the user's folder stays

    earlier = tmp_path / "earlier"
    (earlier / "samples" / "synthetic").mkdir(parents=True)
    sample = journal_path(earlier / "samples" / "synthetic", "ar__ar-tiny")
    sample.write_text('{"key": "k", "output": "4"}\n')
    assert run_cli(capsys, monkeypatch, *args, "--output", str(earlier))[0] == 2
    assert sample.read_text() == '{"key": "k", "output": "4"}\n'  # a run resumes from it: never removed


def test_library_log_handlers_write_to_eval_log_not_the_terminal(capsys, monkeypatch, tmp_path):
    import logging

    from refusion_cli.cli.evaluate import _library_output

    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    handler = logging.StreamHandler(sys.stderr)  # as datasets makes one at import, bound to the terminal
    logger = logging.getLogger("datasets")
    monkeypatch.setattr(logger, "handlers", [handler])
    with _library_output(tmp_path):
        logger.error("Failed to load JSON from file with error pyarrow.lib.ArrowInvalid")
    assert handler.stream is sys.stderr  # given back afterwards
    assert "pyarrow" not in capsys.readouterr().err and "pyarrow" in (tmp_path / "eval.log").read_text()


def test_what_libraries_print_while_planning_goes_to_eval_log(causal_checkpoint, capsys, monkeypatch, tmp_path):
    """Building the tasks (before the run folder exists) makes datasets print a progress bar for a
    new data file; it lands in eval.log with the rest, not on the terminal."""
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(problem) + "\n" for problem in PROBLEMS[7:9]), encoding="utf-8")
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, monkeypatch, "--task", "synthetic", "--decoder", "ar", "--model",
                             str(causal_checkpoint), "--limit", "1", "--set", "gen_length=8", "--data-file",
                             f"synthetic={data}", "--output", str(run_dir))
    assert code == 0, err
    assert err == "" and "Generating test split" in (run_dir / "eval.log").read_text()


def test_earlier_cells_survive_an_entry_this_version_cannot_read(tmp_path):
    from refusion_cli.harness.report import read_results

    good = {"benchmark": "synthetic", "title": "Synthetic", "decoder": "ar", "model": "ar-tiny", "label": "ar:ar-tiny",
            "config_hash": "abc", "config": {}, "samples": 2, "accuracy": 50.0, "lm_eval_accuracy": 50.0, "tps": 1.0,
            "tpf": 1.0, "tokens": 4, "forwards": 4, "seconds": 4.0, "decoded": 2, "resumed": 0, "metric": "m"}
    newer = {**good, "label": "refusion:x", "decoder": "refusion", "field_of_a_later_version": 1}
    broken = {"benchmark": "synthetic"}
    (tmp_path / "metrics.json").write_text(json.dumps({"results": [good, newer, broken, "junk"]}))
    assert [(r.label, r.accuracy) for r in read_results(tmp_path)] == [("ar:ar-tiny", 50.0), ("refusion:x", 50.0)]
    (tmp_path / "metrics.json").write_text("{not json")
    assert read_results(tmp_path) == []


def test_a_decoder_revision_past_the_first_is_part_of_the_sample_key(monkeypatch):
    """Journaled samples are reused under their key: a decoder whose tokens changed (a new revision)
    must decode them again; revision 1 keeps the keys earlier runs journaled under."""
    import dataclasses
    import hashlib

    from refusion_cli.decoding import registry
    from refusion_cli.harness.runner import config_hash

    config = build_config("refusion", {"gen_length": "32"})
    args = ("fingerprint", 0, True, ("cpu", "float32"), "exact_match,none")
    material = {"decoder": "refusion", "config": dataclasses.asdict(config), "model": "fingerprint", "seed": 0,
                "chat_template": True, "device": "cpu", "dtype": "float32", "metric": "exact_match,none"}
    first = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:12]
    assert registry.DECODERS["refusion"].revision == 1 and config_hash("refusion", config, *args) == first
    monkeypatch.setitem(registry.DECODERS, "refusion", dataclasses.replace(registry.DECODERS["refusion"], revision=2))
    assert config_hash("refusion", config, *args) != first
    # 2: float64 confidence over the whole vocabulary; 3: Fast-dLLM's cached steps (llada: their count, dream: tokens)
    assert registry.DECODERS["llada"].revision == registry.DECODERS["dream"].revision == 3


def test_several_eos_ids_are_part_of_the_sample_key():
    """A response that ends at several EOS ids decodes other tokens than one ending at the first id alone;
    a single EOS keeps the keys earlier runs journaled under."""
    from refusion_cli.harness.runner import config_hash

    config = build_config("refusion", {"gen_length": "32"})
    args = ("fingerprint", 0, True, ("cpu", "float32"), "exact_match,none")
    one = config_hash("refusion", config, *args)
    assert config_hash("refusion", config, *args, (151645,)) == one
    two = config_hash("refusion", config, *args, (151645, 151643))
    assert two != one and config_hash("refusion", config, *args, (151643, 151645)) not in (one, two)


def test_notes_printed_into_a_file_are_whole_lines(monkeypatch):
    """Off a terminal Rich wraps at 80 columns; a note cut in two lines is hard to grep in a log."""
    import io

    from rich.console import Console

    from refusion_cli.cli import evaluate

    out = io.StringIO()
    monkeypatch.setattr(evaluate, "console", Console(file=out, width=80))
    view = evaluate.EvalView()
    view.description = "synthetic · refusion:refusion-tiny"
    view.on_requests(total=200, stored=3, other_settings=200)
    lines = out.getvalue().splitlines()
    assert lines == [
        "synthetic · refusion:refusion-tiny: 200 sample(s) here were decoded with other settings; they stay in "
        "samples/ but this run replaces their cell in the summary (another --output keeps both)",
        "synthetic · refusion:refusion-tiny: resuming, 3 of 200 samples already done"]


def test_a_benchmarks_tps_is_its_tokens_over_its_seconds_not_a_mean_of_per_sample_tps():
    from refusion_cli.decoding.stats import run_tps

    def paper_tps(records):
        return run_tps([r["tokens"] for r in records], [r["seconds"] for r in records])

    # a 10-token answer in 0.1 s (100 TPS) and a 300-token answer in 6 s (50 TPS): 310 / 6.1, not 75
    records = [{"tokens": 10, "seconds": 0.1, "tps": 100.0}, {"tokens": 300, "seconds": 6.0, "tps": 50.0}]
    assert paper_tps(records) == 310 / 6.1
    assert paper_tps([]) == 0.0 and paper_tps([{"tokens": 0, "seconds": 0.0, "tps": 0.0}]) == 0.0
