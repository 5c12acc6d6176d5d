"""The benchmark's parts, in-process: option values, configs, prompts, statistics, memory, plots."""

from __future__ import annotations

import json

import pytest
import torch

from refusion_cli.bench.machine import PeakMemory, describe_machine
from refusion_cli.bench.plots import pareto_frontier
from refusion_cli.bench.prompts import SYNTHETIC_TEST, load_prompts
from refusion_cli.bench.runner import BenchSettings, decoder_config, percentile
from refusion_cli.cli.bench import MultiValues, parse_models, parse_overrides, route_stray_values, split_commas
from refusion_cli.errors import UserError
from refusion_cli.harness.suite import load_suite


def test_values_after_an_option_go_back_to_the_option_they_fit():
    # refusion bench --decoder refusion ar llada --gen-length 64 128 --model refusion=A ar=B
    #                --set refusion.slot_size=16 llada.steps=64
    given = MultiValues(["refusion"], ["64"], ["refusion=A"], ["refusion.slot_size=16"])
    routed = route_stray_values(["ar", "llada", "128", "ar=B", "llada.steps=64"], given)
    assert routed.decoders == ["refusion", "ar", "llada"]
    assert routed.gen_lengths == ["64", "128"]
    assert routed.models == ["refusion=A", "ar=B"]
    assert routed.overrides == ["refusion.slot_size=16", "llada.steps=64"]


def test_a_stray_value_whose_option_was_not_given_is_refused():
    with pytest.raises(UserError, match="unexpected argument '128'"):
        route_stray_values(["128"], MultiValues(["refusion"]))
    with pytest.raises(UserError, match="unexpected argument 'ar'"):
        route_stray_values(["ar"], MultiValues())


def test_commas_and_bare_model_paths():
    assert split_commas(["refusion,ar", "llada"]) == ["refusion", "ar", "llada"]
    assert parse_models(["path/to/ckpt"], ("refusion",)) == {"refusion": "path/to/ckpt"}
    with pytest.raises(UserError, match="DECODER=CHECKPOINT"):
        parse_models(["path/to/ckpt"], ("refusion", "ar"))
    assert parse_overrides(["refusion.slot_size=16", "refusion.block_size=64"]) == {
        "refusion": {"slot_size": "16", "block_size": "64"}}
    with pytest.raises(UserError, match="DECODER.OPTION=VALUE"):
        parse_overrides(["slot_size=16"])


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
    assert (tiny.gen_length, tiny.slot_size) == (64, load_suite().preset("synthetic_tiny").slot_size)
    with pytest.raises(UserError, match="--gen-length"):
        decoder_config("refusion", 128, {"gen_length": "64"})
    with pytest.raises(UserError, match="slot_threshold must be in"):
        decoder_config("refusion", 128, {"slot_threshold": "2"})


def test_settings_refuse_options_for_decoders_not_benchmarked():
    with pytest.raises(UserError, match="--model names llada"):
        BenchSettings(decoders=("refusion",), models={"llada": "x"})
    with pytest.raises(UserError, match="--repeats"):
        BenchSettings(repeats=0)
    with pytest.raises(UserError, match="unknown ReFusion preset .nope.; choose one of .*synthetic_tiny"):
        BenchSettings(preset="nope")


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


def test_peak_memory_on_the_cpu_sees_a_large_allocation():
    device = torch.device("cpu")
    with PeakMemory(device) as peak:
        block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
        del block
    machine = describe_machine(device, torch.float32)
    assert peak.method == machine.memory_method
    if "VmHWM" in peak.method:
        assert peak.delta_mib >= 48
    assert machine.dtype == "float32" and machine.threads >= 1 and machine.cpu


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
