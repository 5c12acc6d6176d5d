"""`refusion bench --sweep`: each decoder over a grid of its parallelism settings, and the frontier files.

Through the real entry point, in-process, on the embedded models: AR, ReFusion (and its recheck variant) and
LLaDA, 1 prompt, gen_length 32, no warm-up. One sweep (module fixture) serves the file and frontier tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from refusion_cli.bench.frontier import on_pareto_front
from refusion_cli.bench.runner import BenchSettings, plan_entries
from refusion_cli.bench.sweep import SWEEP_GRIDS, setting_label, sweep_configs
from refusion_cli.decoding.config import ReFusionConfig
from refusion_cli.decoding.dream import DreamConfig
from tests.bench.helpers import bench_captured, error_line, read_csv, run_bench_cli

LENGTH = 32
PROMPTS = 1
COMMON = ["--limit", str(PROMPTS), "--gen-length", str(LENGTH), "--warmup", "0", "--device", "cpu"]
# two grid points, as --set gives them to a run without --sweep
REFUSION_POINT = ["refusion.slot_size=4", "refusion.block_size=16", "refusion.slot_threshold=0.6",
                  "refusion.token_threshold=0.2"]
LLADA_POINT = ["llada.threshold=0.7", "llada.use_cache=true"]


def run_quietly(args: list[str], interrupt_after_rows: int | None = None) -> int:
    """``refusion bench --tps ARGS`` in this process, its output swallowed; its exit code."""
    return bench_captured(args, interrupt_after_rows).returncode


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("sweep") / "out"
    assert run_quietly(["--sweep", "--decoder", "ar", "refusion", "llada", "--recheck", *COMMON,
                        "-o", str(output)]) == 0
    return output


@pytest.mark.slow  # `make test-all` (16 s, a second bench run); by default the plan test below checks that each
# sweep row carries its grid point's settings over the usual row's
def test_a_sweep_row_is_what_a_run_with_that_setting_measures(sweep_run, tmp_path):
    alone = tmp_path / "alone"
    assert run_quietly(["--decoder", "refusion", "llada", "--set", *REFUSION_POINT, *LLADA_POINT, "--recheck",
                        *COMMON, "-o", str(alone)]) == 0

    def decodes(folder: Path, label: str) -> list[tuple[str, ...]]:
        return [(s["prompt"], s["output"], s["tokens"], s["forwards"], s["correct"])
                for s in read_csv(folder / "samples.csv") if s["decoder"] == label]

    def row(folder: Path, label: str) -> dict[str, str]:
        return next(r for r in read_csv(folder / "bench.csv") if r["decoder"] == label)

    for swept, single in (("refusion k=4 b=16 τ=0.6/0.2", "refusion"), ("llada τ=0.7 cache", "llada"),
                          ("refusion (recheck) k=4 b=16 τ=0.6/0.2", "refusion (recheck)")):
        assert decodes(sweep_run, swept) == decodes(alone, single) and len(decodes(alone, single)) == PROMPTS
        for column in ("accuracy", "tokens", "forwards", "tpf", "config"):
            assert row(sweep_run, swept)[column] == row(alone, single)[column], column


def dominated(point: tuple[float, float], others: list[tuple[float, float]]) -> bool:
    return any(o[0] >= point[0] and o[1] >= point[1] and o != point for o in others)


def test_frontier_csv_flags_each_decoders_pareto_front(sweep_run):
    points = read_csv(sweep_run / "frontier.csv")
    rows = read_csv(sweep_run / "bench.csv")
    assert [p["label"] for p in points] == [r["decoder"] for r in rows]  # no ablation row: every row is a point
    assert [p["setting"] for p in points if p["decoder"] == "ar"] == ["greedy"]
    # a variant (recheck; the plan test below has causal_fix too) is a group of its own: its row at the usual
    # setting, then the same grid
    grid = [p["setting"] for p in points if p["decoder"] == "refusion"]
    for name in ("refusion (recheck)",):
        variant = [p for p in points if p["decoder"] == name]
        assert [p["setting"] for p in variant] == grid and len(grid) > 1
        assert [p["label"] for p in variant] == [name] + [f"{name} {setting}" for setting in grid[1:]]
    for decoder in ("ar", "refusion", "llada", "refusion (recheck)"):
        mine = [p for p in points if p["decoder"] == decoder]
        for speed, flag in (("tps", "on_front"), ("tpf", "on_front_tpf")):
            pairs = [(float(p[speed]), float(p["accuracy"])) for p in mine]
            assert [p[flag] for p in mine] == ["false" if dominated(pair, pairs) else "true" for pair in pairs]
        assert any(p["on_front"] == "true" for p in mine)


def test_pareto_front_of_a_hand_made_list():
    #          slow+accurate  fast+poor   dominated   tie (both kept)        beaten on speed only
    points = [(10.0, 0.9), (40.0, 0.2), (5.0, 0.5), (20.0, 0.6), (20.0, 0.6), (15.0, 0.6)]
    assert on_pareto_front(points) == [True, True, False, True, True, False]
    assert on_pareto_front([]) == [] and on_pareto_front([(1.0, 0.0)]) == [True]


def test_the_two_frontier_plots_are_written_in_place_of_frontier_png(sweep_run):
    for name in ("frontier_tps.png", "frontier_tpf.png"):
        assert (sweep_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (sweep_run / "frontier.png").exists()
    report = (sweep_run / "bench.md").read_text()
    assert "Accuracy/speed frontier (--sweep; frontier.csv)" in report
    assert "| refusion | 32 | k=4 b=16 τ=0.6/0.2 |" in report and "![frontier_tpf](frontier_tpf.png)" in report


def test_the_plan_is_deterministic_with_unique_labels_and_the_fixed_settings_under_the_grid():
    settings = BenchSettings(decoders=("llada", "refusion", "ar"), gen_lengths=(32, 64), sweep=True, device="cpu",
                             batch_sizes=(1, 2), overrides={"llada": {"block_length": "16"}}, causal_fix=True,
                             recheck=True)
    entries = plan_entries(settings)
    assert entries == plan_entries(settings)
    for length in (32, 64):
        labels = [entry.label for entry in entries if entry.gen_length == length]
        assert len(labels) == len(set(labels))
        assert [label for label in labels if label.startswith("ar")] == ["ar", "ar (batch 2)"]  # AR: one point
        llada = [entry for entry in entries if entry.gen_length == length and entry.decoder == "llada"]
        assert [entry.label for entry in llada] == [
            "llada", "llada (batch 2)", f"llada steps={length // 2}", f"llada steps={length // 4}",
            f"llada steps={length // 8}", "llada τ=0.9 cache", "llada τ=0.7 cache", "llada τ=0.5 cache"]
        assert {entry.config.block_length for entry in llada} == {16}  # --set of an unswept key: every row
    for name in ("refusion (causal fix)", "refusion (recheck)"):  # each variant: the decoder's grid again
        assert [e.config for e in entries if e.label.startswith(name + " ")] == \
            [e.config for e in entries if e.label.startswith("refusion k=")]
    refusion = [entry.config for entry in entries if entry.gen_length == 64 and entry.label.startswith("refusion k=")]
    assert {config.slot_size for config in refusion} == {4, 8, 16, 32}
    assert {(config.slot_threshold, config.token_threshold) for config in refusion} == {
        (0.9, 0.9), (0.8, 0.5), (0.6, 0.2)}
    # on refusion-tiny the usual row is its own preset's k=4 b=32 (synthetic_tiny), not a point of the grid
    [usual] = [entry.config for entry in entries if entry.gen_length == 64 and entry.label == "refusion"]
    assert (usual.slot_size, usual.block_size) == (4, 32)
    assert len(refusion) == len(SWEEP_GRIDS[ReFusionConfig])
    dream = sweep_configs("dream", DreamConfig(gen_length=64, steps=64))
    assert [setting_label("dream", config) for config in dream] == [
        "steps=32", "steps=16", "steps=8", "τ=0.9 cache", "τ=0.7 cache", "τ=0.5 cache"]
    # on a dual-cache row (the fast-dllm preset's) the fixed schedules run without a cache, the thresholds keep it
    dual = sweep_configs("dream", DreamConfig(gen_length=64, steps=64, block_length=32, threshold=0.9, use_cache=True,
                                              dual_cache=True))
    assert [setting_label("dream", config) for config in dual] == [
        "steps=64", "steps=32", "steps=16", "steps=8", "τ=0.7 dual cache", "τ=0.5 dual cache"]


@pytest.mark.parametrize("args, message", [
    (["--decoder", "refusion", "--set", "refusion.slot_size=4"],
     "error: --sweep varies refusion's slot_size, so --set cannot fix it"),
    (["--decoder", "refusion", "llada", "--set", "threshold=0.9"],
     "error: --sweep varies llada's threshold, so --set cannot fix it"),
])
def test_sweep_with_set_of_a_swept_key_is_one_error_line(args, message, monkeypatch, capsys, tmp_path):
    code, _, err = run_bench_cli(["--sweep", *args, *COMMON, "-o", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and error_line(err).startswith(message)
    assert not (tmp_path / "out").exists()


def test_resume_continues_an_interrupted_sweep(tmp_path):
    output = tmp_path / "out"
    args = ["--sweep", "--decoder", "llada", "--limit", "2", "--gen-length", "16", "--warmup", "0", "--device",
            "cpu", "-o", str(output)]
    assert run_quietly(args, interrupt_after_rows=3) == 130
    assert len(read_csv(output / "bench.csv")) == 3
    planned = [entry.label for entry in plan_entries(BenchSettings(decoders=("llada",), gen_lengths=(16,),
                                                                   sweep=True, device="cpu"))]
    assert run_quietly([*args, "--resume"]) == 0
    assert [row["decoder"] for row in read_csv(output / "bench.csv")] == planned
    assert [point["label"] for point in read_csv(output / "frontier.csv")] == planned
    samples = read_csv(output / "samples.csv")
    assert [(s["decoder"], s["prompt"]) for s in samples] == [(label, p) for label in planned for p in ("0", "1")]
    without = run_quietly([*args[1:], "--resume"])  # the same folder without --sweep is another run
    assert without == 2
