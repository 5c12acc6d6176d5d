"""What a bench run says while and after it runs: the decodes done within a row, the spread of a row's TPS over
its repeats, and a warning when the answers ran into the length budget. One tiny in-process run on ar-tiny."""

from __future__ import annotations

import contextlib
import io
import statistics

import pytest

from refusion_cli.bench.runner import BenchSettings, plan_entries
from refusion_cli.cli.bench_run import BenchRun, RowDecodes
from tests.bench.helpers import bench, read_csv

N_PROMPTS, REPEATS, LENGTH = 2, 3, 4  # 4 tokens: too few for any answer, so every decode runs into the budget


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`refusion bench --decoder ar --gen-length 4 ...` in this process (stdout and stderr captured, so not a
    terminal); the bar's count and total seen after every decode."""
    output = tmp_path_factory.mktemp("bench") / "out"
    counts: list[tuple[float, float | None]] = []
    sample_done = BenchRun.sample_done

    def counted(run: BenchRun, sample) -> None:
        sample_done(run, sample)
        task = run.progress.tasks[-1]
        counts.append((task.completed, task.total))

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr(BenchRun, "sample_done", counted)
        code = bench(patch, ["--decoder", "ar", "--limit", str(N_PROMPTS), "--repeats", str(REPEATS),
                             "--gen-length", str(LENGTH), "--warmup", "0", "--device", "cpu", "--output", str(output)])
    assert code == 0, err.getvalue()
    return output, out.getvalue(), err.getvalue(), counts


def test_the_row_shows_its_decodes_as_they_finish(tiny_run):
    _, out, err, counts = tiny_run
    total = N_PROMPTS * REPEATS
    assert counts == [(done, total) for done in range(1, total + 1)]  # the bar advances with every decode
    # off a terminal (here: captured streams) the same count, a line on stderr at each quarter of the row
    assert [line.strip() for line in err.splitlines() if "decodes" in line] == [
        f"ar @ {LENGTH}: {done}/{total} decodes" for done in (2, 3, 5)]
    assert f"/{total} decodes" not in out  # stdout keeps the row lines and the table


def test_quarter_lines_for_any_row_size():
    for total, expected in ((1, []), (4, [1, 2, 3]), (8, [2, 4, 6]), (10, [3, 5, 8])):
        row = RowDecodes("x", total)
        lines = [row.advance() for _ in range(total)]
        assert [int(line.split(": ")[1].split("/")[0]) for line in lines if line] == expected


def test_the_spread_over_repeats_is_in_the_table_the_csv_and_the_report(tiny_run):
    output, out, _, _ = tiny_run
    [row] = read_csv(output / "bench.csv")
    samples = read_csv(output / "samples.csv")
    per_repeat = [sum(int(s["tokens"]) for s in samples if s["repeat"] == str(r)) /
                  sum(float(s["seconds"]) for s in samples if s["repeat"] == str(r)) for r in range(REPEATS)]
    assert float(row["tps_min"]) == pytest.approx(min(per_repeat), rel=1e-4)
    assert float(row["tps_median"]) == pytest.approx(statistics.median(per_repeat), rel=1e-4)
    assert float(row["tps_max"]) == pytest.approx(max(per_repeat), rel=1e-4)
    assert float(row["tps_min"]) <= float(row["tps"]) <= float(row["tps_max"])
    header = next(line for line in out.splitlines() if line.startswith("decoder"))
    assert header.split()[3:7] == ["TPS", "min", "med", "max"]
    assert f"{float(row['tps_min']):.1f} / {float(row['tps_median']):.1f} / {float(row['tps_max']):.1f}" in (
        output / "bench.md").read_text()


def test_answers_cut_by_the_length_budget_are_counted_and_warned_about(tiny_run):
    output, out, _, _ = tiny_run
    samples = read_csv(output / "samples.csv")
    assert [s["hit_budget"] for s in samples] == ["True"] * N_PROMPTS * REPEATS
    assert all(int(s["tokens"]) == LENGTH for s in samples)
    [row] = read_csv(output / "bench.csv")
    assert float(row["budget_share"]) == 1.0
    warning = f"decodes that used the whole --gen-length without an end token: ar @ {LENGTH} 100%"
    assert f"warning: {warning}" in " ".join(out.split())
    assert f"**Warning**: {warning}" in (output / "bench.md").read_text()
    assert "hit the length budget" in out  # the row's own line says it too


def test_the_recompute_ablation_is_a_row_only_when_asked_for():
    def labels(**ablation: bool) -> list[str]:
        return [e.label for e in plan_entries(BenchSettings(decoders=("refusion",), gen_lengths=(16,), **ablation))]

    assert labels() == ["refusion"]
    assert labels(ablation=True) == ["refusion", "refusion (recompute)"]
