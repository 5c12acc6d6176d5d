"""The benchmark's parts, in-process: option values, configs, prompts, statistics, memory, plots."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from refusion_cli.decoding.spec import preset_config
from refusion_cli.bench.machine import PeakMemory, describe_machine
from refusion_cli.bench.plots import frontier_figure, length_figure, pareto_frontier, plot_length_sweep
from refusion_cli.bench.prompts import SYNTHETIC_TEST, BenchPrompt, load_prompts
from refusion_cli.bench.figures import percentile
from refusion_cli.bench.runner import (BenchRow, BenchSettings, budget_notes, decoder_config, plan_entries,
                                       run_bench)
from refusion_cli.cli.options import MultiValues, route_stray_values, split_commas
from refusion_cli.cli.bench import bench_settings
from refusion_cli.decoding.spec import parse_models, parse_overrides
from refusion_cli.errors import UserError


def test_values_after_an_option_go_back_to_the_option_they_fit():
    # refusion bench --decoder refusion ar llada --gen-length 64 128 --model refusion=A ar=B
    #                --set refusion.slot_size=16 llada.steps=64
    given = MultiValues(["refusion"], ["refusion=A"], ["refusion.slot_size=16"], gen_lengths=["64"])
    routed = route_stray_values(["ar", "llada", "128", "ar=B", "llada.steps=64"], given, "refusion bench")
    assert routed.decoders == ["refusion", "ar", "llada"]
    assert routed.gen_lengths == ["64", "128"]
    assert routed.models == ["refusion=A", "ar=B"]
    assert routed.overrides == ["refusion.slot_size=16", "llada.steps=64"]


def test_a_stray_value_whose_option_was_not_given_is_refused():
    with pytest.raises(UserError, match="unexpected argument '128'"):
        route_stray_values(["128"], MultiValues(["refusion"]), "refusion bench")
    with pytest.raises(UserError, match="unexpected argument 'ar'"):
        route_stray_values(["ar"], MultiValues(), "refusion bench")


def test_commas_and_bare_model_paths():
    # bench speaks the grammar of eval and chat (decoding.spec): a bare checkpoint is every decoder's,
    # a plain KEY=VALUE is every decoder's that has KEY (bench used to refuse both)
    assert split_commas(["refusion,ar", "llada"]) == ["refusion", "ar", "llada"]
    assert parse_models(["path/to/ckpt"], ("refusion",)) == {"refusion": ["path/to/ckpt"]}
    assert parse_models(["path/to/ckpt"], ("refusion", "ar")) == {"refusion": ["path/to/ckpt"], "ar": ["path/to/ckpt"]}
    assert parse_overrides(["refusion.slot_size=16", "refusion.block_size=64"], ("refusion",)) == {
        "refusion": {"slot_size": "16", "block_size": "64"}}
    assert parse_overrides(["slot_size=16"], ("refusion", "ar")) == {"refusion": {"slot_size": "16"}, "ar": {}}
    with pytest.raises(UserError, match="KEY=VALUE or DECODER.KEY=VALUE"):
        parse_overrides([".slot_size=16"], ("refusion",))


def test_mdm_configs_take_one_token_per_step_and_32_token_blocks():
    llada = decoder_config("llada", 64)
    assert (llada.gen_length, llada.steps, llada.block_length) == (64, 64, 32)
    assert decoder_config("llada", 48).block_length == 48  # 32 does not divide 48: one block
    assert decoder_config("llada", 64, {"block_length": "16"}).block_length == 16
    assert decoder_config("dream", 64).steps == 64


def test_refusion_config_from_preset_and_overrides():
    config = decoder_config("refusion", 128, {"token_threshold": "0.5"}, preset="gsm8k")
    assert (config.gen_length, config.slot_size, config.block_size, config.token_threshold) == (128, 32, 128, 0.5)
    tiny = decoder_config("refusion", 64, preset="synthetic_tiny")  # a preset of evals/suite.yaml works too
    assert (tiny.gen_length, tiny.slot_size) == (64, preset_config("synthetic_tiny").slot_size)
    with pytest.raises(UserError, match="--gen-length"):
        decoder_config("refusion", 128, {"gen_length": "64"})
    with pytest.raises(UserError, match="slot_threshold must be in"):
        decoder_config("refusion", 128, {"slot_threshold": "2"})


def test_settings_refuse_options_for_decoders_not_benchmarked():
    with pytest.raises(UserError, match="--model names llada"):
        BenchSettings(decoders=("refusion",), models={"llada": "x"})
    with pytest.raises(UserError, match="--repeats"):
        BenchSettings(repeats=0)
    with pytest.raises(UserError, match="--preset nope: none of the decoders benchmarked .* has a preset") as error:
        BenchSettings(preset="nope")
    assert "synthetic_tiny" in error.value.hint


def test_synthetic_prompts_are_the_held_out_split(tmp_path):
    prompts = load_prompts(None, 3)
    lines = [json.loads(line) for line in SYNTHETIC_TEST.read_text().splitlines()[:3]]
    assert [(p.text, p.target) for p in prompts] == [(row["question"], row["target"]) for row in lines]


def test_prompt_files(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Say hi."}\n\n{"question": "2 + 2?", "target": 4}\n')
    prompts = load_prompts(path)
    assert [(p.text, p.target) for p in prompts] == [("Say hi.", None), ("2 + 2?", "4")]
    assert len(load_prompts(path, limit=1)) == 1
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(UserError, match="line 2, is not valid JSON"):
        load_prompts(path)
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(UserError, match="no 'prompt' or 'question'"):
        load_prompts(path)


def test_percentiles_interpolate_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0


def test_pareto_frontier_keeps_the_points_nothing_beats():
    points = [(10.0, 50.0), (20.0, 40.0), (5.0, 60.0), (15.0, 30.0), (20.0, 45.0)]
    assert pareto_frontier(points) == [(5.0, 60.0), (10.0, 50.0), (20.0, 45.0)]


# The RSS of a test process can fall while a window is open (a thread of an earlier test freeing its memory), which
# hides an allocation as large; a window that sees it shows the method works: the most of three windows is checked.
WINDOWS = 3


def test_peak_memory_on_the_cpu_sees_a_large_allocation():
    device = torch.device("cpu")
    deltas = []
    for _ in range(WINDOWS):
        with PeakMemory(device) as peak:
            block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
            del block
        deltas.append(peak.delta_mib)
    machine = describe_machine(device, torch.float32)
    assert peak.method == machine.memory_method
    if "VmHWM" in peak.method:
        assert max(deltas) >= 48, deltas
    assert machine.dtype == "float32" and machine.threads >= 1 and machine.cpu


def test_peak_memory_is_not_hidden_by_garbage_freed_inside_the_block():
    """Garbage of earlier work (a cycle holding 128 MiB) freed by a collection inside the block does not hide the
    block's own 64 MiB: it is freed before the start."""
    device = torch.device("cpu")
    deltas = []
    for _ in range(WINDOWS):
        cycle: list = [torch.ones(128 * 1024 * 1024 // 4)]
        cycle.append(cycle)
        del cycle
        with PeakMemory(device) as peak:
            gc.collect()  # as an automatic collection would, at any allocation
            block = torch.ones(64 * 1024 * 1024 // 4)
            del block
        deltas.append(peak.delta_mib)
    if "VmHWM" in peak.method:
        assert max(deltas) >= 48, deltas


def test_prompt_files_with_a_byte_order_mark_or_bad_fields(tmp_path):
    from refusion_cli.bench.prompts import read_prompt_file

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('{"prompt": "Hi", "target": "1"}\n'.encode("utf-8-sig"))
    assert [(p.text, p.target) for p in read_prompt_file(bom)] == [("Hi", "1")]
    number = tmp_path / "number.jsonl"
    number.write_text('{"prompt": 5}\n')
    with pytest.raises(UserError, match=r"number.jsonl, line 1: 'prompt' must be a non-empty string"):
        read_prompt_file(number)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"the prompts file .*latin.jsonl is not UTF-8 text \(byte 15\)"):
        read_prompt_file(latin)


def test_a_length_given_twice_is_measured_once(causal_checkpoint):
    settings = BenchSettings(decoders=("ar", "refusion"), gen_lengths=(16, 16, 32), ablation=True,
                             models={"ar": str(causal_checkpoint), "refusion": str(causal_checkpoint)})
    assert [(entry.label, entry.gen_length) for entry in plan_entries(settings)] == [
        ("ar", 16), ("ar", 32), ("refusion", 16), ("refusion (recompute)", 16), ("refusion", 32),
        ("refusion (recompute)", 32)]


def test_by_default_every_decoder_with_an_embedded_model_is_measured_fast_dllm_on_mdm_tiny():
    entries = plan_entries(BenchSettings(gen_lengths=(64,)))
    assert [(entry.label, entry.model) for entry in entries] == [  # no (recompute) row: the ablation is opt-in
        ("ar", "ar-tiny"), ("refusion", "refusion-tiny"), ("llada", "mdm-tiny"), ("llada-fast-dllm", "mdm-tiny")]
    fast = entries[-1].config
    assert (fast.threshold, fast.use_cache, fast.dual_cache, fast.block_length) == (0.9, True, True, 32)


def test_a_length_refusion_rounds_up_to_whole_slots_is_named(causal_checkpoint):
    """ReFusion may decode more tokens than AR at a length that is not a multiple of its slot size."""
    settings = BenchSettings(decoders=("ar", "refusion"), gen_lengths=(30, 32),
                             models={"ar": str(causal_checkpoint), "refusion": str(causal_checkpoint)},
                             overrides={"refusion": {"slot_size": "8"}})
    assert budget_notes(plan_entries(settings)) == [
        "at --gen-length 30 refusion may decode up to 32 tokens (gen_length is rounded up to a multiple of "
        "slot_size 8); the other decoders stop at 30"]


def test_the_report_states_the_runs_notes(tmp_path):
    from refusion_cli.bench.machine import Machine
    from refusion_cli.bench.report import write_markdown

    machine = Machine("cpu", "a CPU", "a CPU", "2.13.0", 2, "float32", "a method")
    write_markdown(tmp_path / "bench.md", [], machine, prompts="2 prompts", warmup=0, repeats=1, seed=0, plots=[],
                   notes=["refusion may decode up to 32 tokens"])
    assert "- Note: refusion may decode up to 32 tokens\n" in (tmp_path / "bench.md").read_text()


def test_switching_models_frees_the_previous_one_before_the_next_loads(causal_checkpoint, bidirectional_checkpoint,
                                                                      monkeypatch):
    """One model at a time: with two 8B checkpoints on one GPU, holding both during the load doubles the weights."""
    import gc
    import weakref

    from refusion_cli.bench import runner

    loaded_before: list[weakref.ref] = []
    alive_at_load: list[list[bool]] = []

    def load_and_watch(*args, **kwargs):
        gc.collect()
        alive_at_load.append([ref() is not None for ref in loaded_before])
        loaded = load_model(*args, **kwargs)
        loaded_before.append(weakref.ref(loaded.model))
        return loaded

    load_model = runner.load_model
    monkeypatch.setattr(runner, "load_model", load_and_watch)
    settings = BenchSettings(decoders=("ar", "llada"), gen_lengths=(8,), warmup=0,
                             models={"ar": str(causal_checkpoint), "llada": str(bidirectional_checkpoint)})
    rows = list(run_bench(settings, [BenchPrompt("Say hi.", None)]))
    assert [row.decoder for row in rows] == ["ar", "llada"]
    assert alive_at_load == [[], [False]]


def test_two_decoders_on_one_checkpoint_share_one_resolve_and_one_load(causal_checkpoint, monkeypatch):
    """`bench --model X --decoder ar refusion`: X is resolved once while planning and loaded once, with the mask
    token refusion needs (it used to load again when the next decoder needed a mask and AR had not)."""
    from refusion_cli.bench import runner

    resolved, loads = [], []
    resolve, load = runner.resolve_checkpoint, runner.load_model
    monkeypatch.setattr(runner, "resolve_checkpoint", lambda name, *rest: resolved.append(name) or resolve(name, *rest))
    monkeypatch.setattr(runner, "load_model", lambda checkpoint, *args, **kwargs: loads.append(
        (checkpoint.name, kwargs["require_mask"])) or load(checkpoint, *args, **kwargs))
    settings = BenchSettings(decoders=("ar", "refusion"), gen_lengths=(8,), warmup=0, ablation=False,
                             models={"ar": str(causal_checkpoint), "refusion": str(causal_checkpoint)})
    rows = list(run_bench(settings, [BenchPrompt("Say hi.", None)]))
    assert [row.decoder for row in rows] == ["ar", "refusion"]
    assert resolved == [str(causal_checkpoint)] and loads == [(str(causal_checkpoint), True)]


def test_one_decoder_given_two_checkpoints_or_one_option_two_values_is_refused():
    # eval runs a decoder on each checkpoint given; bench measures one per decoder
    assert parse_models(["ar=ar-tiny", "ar=other"], ("ar", "refusion")) == {"ar": ["ar-tiny", "other"],
                                                                            "refusion": ["refusion-tiny"]}
    with pytest.raises(UserError, match=r"^--model gives ar two checkpoints: ar-tiny and other$") as error:
        bench_settings(MultiValues(["ar"], ["ar=ar-tiny", "ar=other"], []), None)
    assert error.value.hint == "refusion bench runs each decoder on one checkpoint; refusion eval runs it on each"
    assert parse_models(["ar=ar-tiny", "ar=ar-tiny"], ("ar",)) == {"ar": ["ar-tiny"]}
    with pytest.raises(UserError, match=r"^--set gives refusion.slot_size two values: 8 and 16$"):
        parse_overrides(["refusion.slot_size=8", "refusion.slot_size=16"], ("refusion",))
    assert parse_overrides(["refusion.slot_size=8", "refusion.slot_size=8"], ("refusion",)) == {
        "refusion": {"slot_size": "8"}}


@pytest.mark.parametrize("target", ['"Paris"', '""', "[4]", "true", '"$18"'])
def test_a_target_no_answer_can_match_is_refused(target, tmp_path):
    """Scoring reads a number: a text target would be scored wrong on every decode, a silent 0 % accuracy."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok", "target": 4}\n' + '{"prompt": "Capital of France?", "target": ' + target + "}\n")
    with pytest.raises(UserError) as error:
        load_prompts(path)
    assert str(error.value) == (f"{path}, line 2: 'target' must be a number (answers are scored by the number after "
                                f"'####', else the last number), got {target}")


def test_numeric_targets_are_kept_as_written(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a", "target": 4}\n{"prompt": "b", "target": "1,000"}\n'
                    '{"prompt": "c", "target": -2.5}\n{"prompt": "d", "target": null}\n')
    assert [p.target for p in load_prompts(path)] == ["4", "1,000", "-2.5", None]


def bench_row(decoder: str, gen_length: int, tps: float, accuracy: float | None) -> BenchRow:
    return BenchRow(decoder=decoder, model="m", gen_length=gen_length, prompts=1, decodes=1, tps=tps,
                    speedup_vs_ar=None, tpf=1.0, forwards=1.0, tokens=1.0, latency_p50_ms=1000 / tps,
                    latency_p95_ms=1000 / tps, peak_mem_mib=0.0, accuracy=accuracy, scored=1, config="")


def overlaps(box, other) -> bool:
    return box.x0 < other.x1 and other.x0 < box.x1 and box.y0 < other.y1 and other.y0 < box.y1


def test_the_frontier_plot_hides_no_point_behind_its_legend_or_frame():
    rows = [bench_row("ar", 64, 30.0, 1.0), bench_row("refusion", 64, 120.0, 1.0), bench_row("llada", 64, 10.0, 0.0),
            bench_row("refusion (recompute)", 64, 90.0, 0.0)]
    figure = frontier_figure(rows)
    figure.draw_without_rendering()
    (axes,) = figure.axes
    low, high = axes.get_ylim()
    assert low < 0 and high > 100  # points at 0 % and 100 % are drawn whole
    assert not overlaps(axes.get_legend().get_window_extent(), axes.get_window_extent())
    assert "frontier" not in [text.get_text() for text in axes.get_legend().get_texts()]  # one point: no line


def test_the_length_plot_needs_two_lengths_and_keeps_its_legend_off_the_lines(tmp_path):
    single = [bench_row("ar", 64, 30.0, None), bench_row("refusion", 64, 120.0, None)]
    assert plot_length_sweep(single, tmp_path / "one.png") is False and not (tmp_path / "one.png").exists()
    rows = single + [bench_row("ar", 128, 29.0, None), bench_row("refusion", 128, 110.0, None)]
    assert plot_length_sweep(rows, tmp_path / "two.png") is True
    assert (tmp_path / "two.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figure = length_figure(rows)
    figure.draw_without_rendering()
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["ar", "refusion"]
    assert not any(overlaps(legend.get_window_extent(), axes.get_window_extent()) for axes in figure.axes)
