"""`refusion bench --tps --resume`: an interrupted run continued, a finished one reported again, and the refusals.

Through the real entry point, in-process (for speed). Ctrl-C is a KeyboardInterrupt raised right after one
of BenchRun's hooks (a sample or a row done), so every run stops at the same place. The interrupted runs
are made once per module and copied into each test's folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from refusion_cli.bench.prompts import load_prompts, prompts_digest
from refusion_cli.bench.report import ROW_FIELDS, CsvRows, read_records, row_from_record
from refusion_cli.bench.runner import BenchRow, decoder_config
from refusion_cli.errors import UserError
from tests.bench.helpers import bench, error_line, files_in, previous_run, read_csv, watch

LABELS = ("ar", "refusion", "refusion (recompute)")  # the plan of bench_args, in measuring order
N_PROMPTS, REPEATS = 2, 2
PER_ROW = N_PROMPTS * REPEATS  # samples of one row


def bench_args(checkpoint: Path, output: Path, *more: str) -> list[str]:
    return ["--decoder", "ar", "refusion", "--model", f"ar={checkpoint}", f"refusion={checkpoint}", "--limit",
            str(N_PROMPTS), "--gen-length", "16", "--warmup", "0", "--repeats", str(REPEATS), "--ablation", "-o",
            str(output), *more]


def interrupted_run(folder: Path, checkpoint: Path, hook: str, count: int) -> tuple[Path, str, str]:
    """A run stopped by Ctrl-C right after ``count`` calls of ``hook``: its folder, stdout and stderr."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        watch(patch, hook, interrupt_at=count)
        code = bench(patch, bench_args(checkpoint, folder))
    assert code == 130, stderr.getvalue()
    return folder, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def stopped_in_row_2(causal_checkpoint, tmp_path_factory):
    """Ctrl-C during the second row, after its first sample: bench.csv holds AR's row, samples.csv its
    samples and the first of refusion's."""
    return interrupted_run(tmp_path_factory.mktemp("bench") / "out", causal_checkpoint, "sample_done", PER_ROW + 1)


@pytest.fixture(scope="module")
def stopped_after_all_rows(causal_checkpoint, tmp_path_factory):
    """Ctrl-C after the last row finished: every row there, the report marked Interrupted."""
    return interrupted_run(tmp_path_factory.mktemp("bench") / "out", causal_checkpoint, "row_done", len(LABELS))


def copied(run: tuple[Path, str, str], tmp_path: Path) -> Path:
    return Path(shutil.copytree(run[0], tmp_path / "out"))


def sample_keys(samples: list[dict[str, str]]) -> list[tuple[str, str, str, str]]:
    return [(sample["decoder"], sample["gen_length"], sample["prompt"], sample["repeat"]) for sample in samples]


def planned_samples(labels: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    return [(label, "16", str(prompt), str(repeat))
            for label in labels for prompt in range(N_PROMPTS) for repeat in range(REPEATS)]


def test_an_interrupted_run_writes_run_json_and_says_how_to_continue(stopped_in_row_2):
    output, out, err = stopped_in_row_2
    assert f"stopped: 1 finished row(s) kept in {output}; the same command with --resume continues it\n" in out
    assert err.rstrip().endswith("error: interrupted")
    record = json.loads((output / "run.json").read_text())
    assert record["machine"] == json.loads((output / "machine.json").read_text())
    assert [entry["label"] for entry in record["entries"]] == list(LABELS)
    assert record["entries"][1]["config"] == dataclasses.asdict(decoder_config("refusion", 16))
    assert [(entry["kv_reuse"], entry["gen_length"]) for entry in record["entries"]] == [
        (True, 16), (True, 16), (False, 16)]
    assert record["prompts"] == {"source": "the first 2 problems of the synthetic task (evals/synthetic/test.jsonl)",
                                 "count": N_PROMPTS, "sha256": prompts_digest(load_prompts(None, N_PROMPTS))}
    settings = record["settings"]
    assert (settings["decoders"], settings["gen_lengths"], settings["limit"], settings["warmup"], settings["repeats"],
            settings["seed"], settings["threads"], settings["ablation"], settings["causal_fix"]) == (
        ["ar", "refusion"], [16], N_PROMPTS, 0, REPEATS, 0, None, True, False)


def test_resume_measures_only_the_rows_the_interrupted_run_did_not_finish(stopped_in_row_2, causal_checkpoint,
                                                                         tmp_path, monkeypatch, capsys):
    output = copied(stopped_in_row_2, tmp_path)
    rows_before = (output / "bench.csv").read_bytes()
    samples_before = read_csv(output / "samples.csv")
    assert sample_keys(samples_before) == planned_samples(LABELS[:2])[:PER_ROW + 1]  # one sample of row 2
    measured = watch(monkeypatch, "row_done")
    decoded = watch(monkeypatch, "sample_done")
    assert bench(monkeypatch, bench_args(causal_checkpoint, output, "--resume")) == 0
    rows = read_csv(output / "bench.csv")
    assert [(row["decoder"], row["gen_length"]) for row in rows] == [(label, "16") for label in LABELS]
    assert (output / "bench.csv").read_bytes().startswith(rows_before)  # AR's line as the first process wrote it
    samples = read_csv(output / "samples.csv")
    assert sample_keys(samples) == planned_samples(LABELS)  # row 2's first sample once, from the second process
    assert samples[:PER_ROW] == samples_before[:PER_ROW]
    assert len(decoded) == 2 * PER_ROW
    ar_tps = float(rows[0]["tps"])
    assert [row.decoder for row in measured] == list(LABELS[1:])
    for row, line in zip(measured, rows[1:]):
        assert row.speedup_vs_ar == row.tps / ar_tps
        assert float(line["speedup_vs_ar"]) == round(row.speedup_vs_ar, 6)
    report = (output / "bench.md").read_text()
    assert "Interrupted" not in report
    assert "**Resumed**: the first 1 of the 3 rows were measured before this process continued the run" in report
    assert all(f"| {label} |" in report for label in LABELS)
    out = capsys.readouterr().out
    assert out.startswith("refusion @ 16: ")  # the rows measured now, not AR's


@pytest.mark.parametrize("decoders", [["refusion,ar"], ["refusion", "--decoder", "ar", "--decoder", "ar"]])
def test_resume_takes_the_decoders_in_another_order_or_twice_when_the_plan_is_the_same(
        decoders, stopped_in_row_2, causal_checkpoint, tmp_path, monkeypatch):
    """The run was given ``--decoder ar refusion``; AR is measured first whatever the order, so the rows are the same."""
    output = copied(stopped_in_row_2, tmp_path)
    args = bench_args(causal_checkpoint, output, "--resume")
    at = args.index("--decoder")
    args[at + 1:at + 3] = decoders
    measured = watch(monkeypatch, "row_done")
    assert bench(monkeypatch, args) == 0
    assert [row.decoder for row in measured] == list(LABELS[1:])
    assert [row["decoder"] for row in read_csv(output / "bench.csv")] == list(LABELS)


def test_a_record_cut_mid_write_is_dropped_and_measured_again(stopped_in_row_2, causal_checkpoint, tmp_path,
                                                              monkeypatch):
    """A kill while writing a line leaves it without its end: refusion's row line (after all its samples) and
    a sample line cut halfway."""
    output = copied(stopped_in_row_2, tmp_path)
    rows_before = (output / "bench.csv").read_bytes()
    ar_line = rows_before.split(b"\r\n")[1]
    with (output / "bench.csv").open("ab") as handle:
        handle.write(ar_line.replace(b"ar,", b"refusion,", 1)[:40])
    samples_text = (output / "samples.csv").read_bytes()
    with (output / "samples.csv").open("ab") as handle:
        handle.write(samples_text.split(b"\r\n")[1][:30])
    assert bench(monkeypatch, bench_args(causal_checkpoint, output, "--resume")) == 0
    assert [row["decoder"] for row in read_csv(output / "bench.csv")] == list(LABELS)
    assert (output / "bench.csv").read_bytes().startswith(rows_before)
    assert sample_keys(read_csv(output / "samples.csv")) == planned_samples(LABELS)


def test_resume_of_a_finished_run_measures_nothing_and_completes_its_report(stopped_after_all_rows,
                                                                            causal_checkpoint, tmp_path,
                                                                            monkeypatch, capsys):
    output = copied(stopped_after_all_rows, tmp_path)
    assert "**Interrupted**" in (output / "bench.md").read_text()
    csv_files = {name: (output / name).read_bytes() for name in ("bench.csv", "samples.csv", "run.json")}

    def no_model(*args, **kwargs):
        raise AssertionError("a finished run loaded a model or decoded")

    monkeypatch.setattr("refusion_cli.bench.runner.load_model", no_model)
    monkeypatch.setattr("refusion_cli.bench.runner.run_decoder", no_model)
    assert bench(monkeypatch, bench_args(causal_checkpoint, output, "--resume")) == 0
    out = capsys.readouterr().out
    assert out == (f"the run in {output} is complete (3 rows): nothing to measure; rewrote bench.md, machine.json, "
                   f"frontier.png from bench.csv\n")
    assert {name: (output / name).read_bytes() for name in csv_files} == csv_files
    report = (output / "bench.md").read_text()
    assert "Interrupted" not in report
    assert "**Resumed**: the first 3 of the 3 rows were measured before this process continued the run" in report
    assert all(f"| {label} |" in report for label in LABELS)


def edit_json(path: Path, part: str, key: str, value) -> None:
    record = json.loads(path.read_text())
    record[part][key] = value
    path.write_text(json.dumps(record))


def replace_bytes(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))


def drop_second_record(path: Path) -> None:
    lines = path.read_bytes().split(b"\r\n")
    path.write_bytes(b"\r\n".join(lines[:2] + lines[3:]))


NUMBERS = {"threads": torch.get_num_threads(), "torch": torch.__version__}
REFUSALS = {
    # name: (change to the folder, options after the interrupted run's (the last value counts; --gen-length
    # adds one), the error line's start)
    "no run.json": (lambda out: (out / "run.json").unlink(), [],
                    "error: nothing to resume in OUT: no run.json (hint: leave --resume out to start a new run"),
    "no bench.csv": (lambda out: (out / "bench.csv").unlink(), [], "error: nothing to resume in OUT: no bench.csv"),
    "other lengths": (None, ["--gen-length", "32"], "error: --resume needs the same settings as the interrupted "
                      "run: gen lengths 16 there, 16,32 here"),
    "other repeats": (None, ["--repeats", "3"], "error: --resume needs the same settings as the interrupted run: "
                      "repeats 2 there, 3 here (hint:"),
    "other prompts": (None, ["--limit", "1"], "error: --resume needs the same settings as the interrupted run: "
                      "limit 2 there, 1 here; prompts 2 (sha256 "),
    "other seed": (None, ["--seed", "5"], "error: --resume needs the same settings as the interrupted run: seed 0 "
                   "there, 5 here (hint:"),
    "other torch": (lambda out: edit_json(out / "run.json", "machine", "torch", "1.0.0"), [],
                    "error: --resume needs the same machine as the interrupted run: torch 1.0.0 there, {torch} here"),
    "other threads": (lambda out: edit_json(out / "run.json", "machine", "threads", 999), [],
                      "error: --resume needs the same machine as the interrupted run: threads 999 there, {threads} "
                      "here"),
    "other cpu": (lambda out: edit_json(out / "run.json", "machine", "cpu", "Another CPU"), [],
                  "error: --resume needs the same machine as the interrupted run: cpu Another CPU there,"),
    "run.json not JSON": (lambda out: (out / "run.json").write_text("{"), [],
                          "error: cannot resume from OUT/run.json: it is not JSON"),
    "run.json without machine": (lambda out: (out / "run.json").write_text('{"settings": {}, "prompts": {}, '
                                                                        '"entries": []}'), [],
                                 "error: cannot resume from OUT/run.json: it has no valid machine"),
    "bench.csv edited": (lambda out: replace_bytes(out / "bench.csv", b"\r\nar,", b'\r\n"ar",'), [],
                         "error: cannot resume from OUT/bench.csv: record 1 is not as this toolkit writes it"),
    "bench.csv other columns": (lambda out: replace_bytes(out / "bench.csv", b"decoder,", b"label,"), [],
                                "error: cannot resume from OUT/bench.csv: its columns are not the ones this version "
                                "writes"),
    "samples.csv lacks one": (lambda out: drop_second_record(out / "samples.csv"), [],
                              "error: cannot resume from OUT/samples.csv: record 2 is ar @ 16, prompt 1, repeat 0, "
                              "where the run has ar @ 16, prompt 0, repeat 1"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_a_folder_resume_cannot_continue_is_refused_and_left_as_it_was(name, stopped_in_row_2, causal_checkpoint,
                                                                       tmp_path, monkeypatch, capsys):
    change, options, message = REFUSALS[name]
    output = copied(stopped_in_row_2, tmp_path)
    if change is not None:
        change(output)
    before = files_in(output)
    assert bench(monkeypatch, bench_args(causal_checkpoint, output, "--resume", *options)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert error_line(err).startswith(message.replace("OUT", str(output)).format(**NUMBERS))
    assert files_in(output) == before


def test_resume_in_a_folder_of_no_interrupted_run_is_refused(causal_checkpoint, tmp_path, monkeypatch, capsys):
    """A folder that never held a run, and one of files without run.json (from before --resume)."""
    output = tmp_path / "new"
    assert bench(monkeypatch, bench_args(causal_checkpoint, output, "--resume")) == 2
    assert error_line(capsys.readouterr().err) == (f"error: nothing to resume in {output}: no run.json (hint: leave "
                                                   f"--resume out to start a new run in the folder (it replaces the "
                                                   f"files once its first row finishes))")
    assert not output.exists()
    before = previous_run(output)
    assert bench(monkeypatch, bench_args(causal_checkpoint, output, "--resume")) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: nothing to resume in {output}: no run.json")
    assert files_in(output) == before


# ---------------------------------------------------------------------------------------------
# the CSV files read back

FIELDS = ["name", "text"]
RECORDS = [{"name": "plain", "text": "no quoting"}, {"name": "comma, quote", "text": 'say "hi", then\nstop'},
           {"name": "crlf", "text": "line one\r\nline two\r\n"}, {"name": "é", "text": "Grüße — 文字"},
           {"name": "", "text": ""}]


def written(path: Path, records: list[dict[str, str]], keep: int = 0) -> bytes:
    with CsvRows(path, FIELDS, keep=keep) as rows:
        for record in records:
            rows.write(record)
    return path.read_bytes()


def test_a_csv_file_cut_at_any_byte_reads_as_the_records_written_before_the_cut(tmp_path):
    """Quoted commas, quotes, line ends inside values and multi-byte characters: wherever a kill cuts the file,
    the records read back are exactly those written whole, and the ends say where they stop."""
    data = written(tmp_path / "whole.csv", RECORDS)
    whole = read_records(tmp_path / "whole.csv", FIELDS)
    assert whole.records == RECORDS and whole.ends[-1] == len(data) and len(whole.ends) == len(RECORDS) + 1
    cut = tmp_path / "cut.csv"
    for size in range(len(data) + 1):
        cut.write_bytes(data[:size])
        complete = sum(end <= size for end in whole.ends[1:])
        found = read_records(cut, FIELDS)
        assert found.records == RECORDS[:complete], size
        assert found.ends == (whole.ends[:complete + 1] if size >= whole.ends[0] else [0]), size
    assert read_records(tmp_path / "missing.csv", FIELDS).records == []


def test_csv_rows_continue_a_file_from_its_kept_records(tmp_path):
    path = tmp_path / "rows.csv"
    written(path, RECORDS[:3])
    kept = read_records(path, FIELDS).ends[2]
    data = written(path, RECORDS[3:], keep=kept)
    assert read_records(path, FIELDS).records == RECORDS[:2] + RECORDS[3:]
    assert data == written(tmp_path / "fresh.csv", RECORDS[:2] + RECORDS[3:])


@pytest.mark.parametrize("tail, message", [
    (b'"plain",x\r\n', "record 1 is not as this toolkit writes it"),  # quoted where CsvRows would not quote
    (b"plain,x\r\none\r\n", "record 2 has 1 values, not 2"),
    (b"plain,x\r\n\xff\xfe,x\r\n", "record 2 is not UTF-8"),
    (b"plain,x\r\nbare\"quote,y\r\nplain,z\r\n", "record 2 is not as this toolkit writes it"),
])
def test_a_record_csvrows_would_not_write_is_refused_not_dropped(tail, message, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"name,text\r\n" + tail)
    with pytest.raises(UserError, match=f"^cannot resume from {path}: {message}$"):
        read_records(path, FIELDS)


def test_a_character_cut_in_half_ends_the_file_like_any_cut(tmp_path):
    path = tmp_path / "cut.csv"
    path.write_bytes(b"name,text\r\nplain,x\r\n\xc3")  # the first byte of "é"
    assert read_records(path, FIELDS).records == [{"name": "plain", "text": "x"}]


def test_a_bench_row_reads_back_from_bench_csv_as_written(tmp_path):
    row = BenchRow(decoder="refusion", model="refusion-tiny", gen_length=64, prompts=2, decodes=4, tps=123.456789,
                   speedup_vs_ar=None, tpf=2.5, forwards=10.25, tokens=25.625, latency_p50_ms=80.125,
                   latency_p95_ms=90.5, peak_mem_mib=1.75, accuracy=None, scored=0, config="gen_length=64 slot_size=8")
    with CsvRows(tmp_path / "bench.csv", ROW_FIELDS) as rows:
        rows.write(row.as_dict())
    assert [row_from_record(record) for record in read_records(tmp_path / "bench.csv", ROW_FIELDS).records] == [row]
