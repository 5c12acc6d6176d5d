"""eval, bench, chat and lm-eval's model_args read decoder options in one grammar and count TPS by one rule."""

from __future__ import annotations

import json

import pytest

from refusion_cli.bench.runner import BenchEntry, BenchSample, plan_entries, summarise
from refusion_cli.chat.session import chat_config
from refusion_cli.cli.bench import bench_settings
from refusion_cli.cli.chat import chat_choice
from refusion_cli.cli.options import MultiValues
from refusion_cli.decoding.config import ARConfig
from refusion_cli.decoding.spec import preset_config
from refusion_cli.errors import UserError
from refusion_cli.harness.journal import journal_files, read_records
from refusion_cli.harness.model_args import decoder_config as model_args_config
from refusion_cli.harness.runner import EvalOptions, plan_eval, run_eval

LENGTH = 192  # the synthetic benchmark's response budget, which eval takes from the suite

# (decoder, --model values, --set values, --preset): each spelled the same way for every command (without
# --preset, eval starts ReFusion from the benchmark's own preset and bench and chat from the defaults)
SPELLINGS = [
    ("refusion", [], ["slot_size=8", "token_threshold=0.5"], "synthetic_tiny"),
    ("refusion", ["refusion=refusion-tiny"], ["refusion.slot_threshold=0.7"], "gsm8k"),
    ("refusion", ["refusion-tiny"], ["block_size=64"], "math"),
    ("ar", ["ar-tiny"], [], None),
    ("llada", ["llada=mdm-tiny"], ["llada.block_length=64", "cfg_scale=0.5"], None),
]


def eval_config(tmp_path, decoder, models, sets, preset):
    options = EvalOptions(tasks=["synthetic"], decoders=[decoder], output=tmp_path / "run", models=models,
                          overrides=sets, preset=preset, limit=0, device="cpu")
    plan = plan_eval(options)
    [run] = plan.runs
    return run.model, plan.configs[("synthetic", run.label)]


def bench_config(decoder, models, sets, preset):
    settings = bench_settings(MultiValues([decoder], list(models), list(sets), gen_lengths=[str(LENGTH)]), preset,
                              device="cpu")
    [entry] = [e for e in plan_entries(settings) if e.label == decoder]
    return entry.model, entry.config


def chat_config_of(decoder, models, sets, preset):
    # chat has no --gen-length: its response budget is a --set like any other setting
    choice = chat_choice(decoder, models[0] if models else None, [*sets, f"gen_length={LENGTH}"], preset)
    return choice.model, chat_config(decoder, choice.overrides, preset)


@pytest.mark.parametrize("decoder, models, sets, preset", SPELLINGS)
def test_the_same_option_strings_give_eval_bench_and_chat_the_same_model_and_config(tmp_path, decoder, models, sets,
                                                                                    preset):
    from_eval = eval_config(tmp_path, decoder, models, sets, preset)
    assert bench_config(decoder, models, sets, preset) == from_eval
    assert chat_config_of(decoder, models, sets, preset) == from_eval
    # lm-eval's model_args: KEY=VALUE for the adapter's decoder, preset= as --preset
    options = {key.rpartition(".")[2]: value for key, value in (s.split("=", 1) for s in sets)}
    assert model_args_config(decoder, preset, {**options, "gen_length": str(LENGTH)}) == from_eval[1]


@pytest.mark.parametrize("flags", [(True, False, False), (False, True, True), (True, True, False), (True, True, True)])
def test_the_variant_options_add_the_same_rows_to_eval_and_bench(tmp_path, flags):
    fix, first, again = flags
    plan = plan_eval(EvalOptions(tasks=["synthetic"], decoders=["refusion"], output=tmp_path / "run", limit=0,
                                 device="cpu", causal_fix=fix, causal_first=first, recheck=again))
    settings = bench_settings(MultiValues(["refusion"], [], [], gen_lengths=[str(LENGTH)]), None, device="cpu",
                              ablation=False, causal_fix=fix, causal_first=first, recheck=again)
    entries = plan_entries(settings)
    assert [(run.label.partition(":")[0], run.variant) for run in plan.runs] == [
        (entry.label, (entry.causal_fix, entry.causal_first, entry.recheck)) for entry in entries]
    assert len(entries) == {(True, False, False): 2, (False, True, True): 3, (True, True, False): 4,
                            (True, True, True): 6}[flags]  # the paper's decoder, then each variant asked for


@pytest.mark.parametrize("preset", ["gsm8k", "mmlu_pro", "synthetic_tiny"])
def test_a_preset_is_the_same_config_everywhere(tmp_path, preset):
    expected = preset_config(preset)
    for config in (eval_config(tmp_path, "refusion", [], [], preset)[1], bench_config("refusion", [], [], preset)[1],
                   chat_config_of("refusion", [], [], preset)[1], model_args_config("refusion", preset, {})):
        assert (config.slot_size, config.block_size, config.slot_threshold, config.token_threshold) == (
            expected.slot_size, expected.block_size, expected.slot_threshold, expected.token_threshold)


def test_bench_and_eval_report_the_same_tps_for_the_same_decodes(tmp_path):
    options = EvalOptions(tasks=["synthetic"], decoders=["ar"], output=tmp_path / "run", overrides=["gen_length=24"],
                          limit=4, device="cpu")
    [result] = run_eval(options)
    [journal] = journal_files(tmp_path / "run" / "samples" / "synthetic", "ar__ar-tiny")[:1]
    records = list(read_records([journal]))
    assert len(records) == 4 and len({r["seconds"] for r in records}) > 1
    samples = [BenchSample("ar", 24, i, 0, r["tokens"], r["forwards"], r["seconds"], r["tps"], r["tpf"], None, "")
               for i, r in enumerate(records)]
    row = summarise(BenchEntry("ar", "ar", "ar-tiny", 24, ARConfig(gen_length=24)), samples, 4, 0.0, None)
    total_tokens, total_seconds = sum(r["tokens"] for r in records), sum(r["seconds"] for r in records)
    assert row.tps == result.tps == total_tokens / total_seconds
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["results"][0]
    assert metrics["tps"] == row.tps
    assert metrics["tps_sample_mean"] == pytest.approx(row.tps_sample_mean, rel=1e-12)
    assert row.tps_sample_mean == pytest.approx(sum(r["tokens"] / r["seconds"] for r in records) / 4, rel=1e-12)


def test_several_values_after_one_option_are_read_alike_by_every_command():
    # --set a=1 b=2 (click hands the second value over as a stray argument), --set a=1,b=2, --set a=1 --set b=2
    spaced = chat_choice("refusion", None, ["slot_size=8"], None, ["token_threshold=0.5"])
    assert spaced == chat_choice("refusion", None, ["slot_size=8,token_threshold=0.5"], None)
    assert spaced == chat_choice("refusion", None, ["slot_size=8", "token_threshold=0.5"], None)
    assert dict(spaced.overrides) == {"slot_size": "8", "token_threshold": "0.5"}
    with pytest.raises(UserError, match="unexpected argument 'extra'"):
        chat_choice("refusion", None, [], None, ["extra"])


def parsed(command: str, *args: str) -> dict:
    """The values ``refusion COMMAND ARGS`` hands its function, read through the app's one list grammar."""
    import typer

    from refusion_cli.cli.app import app

    group = typer.main.get_command(app)
    ctx = group.make_context("refusion", [command, *args])
    name, loaded, rest = group.resolve_command(ctx, [command, *args])
    return loaded.make_context(name, rest, parent=ctx).params


def test_every_multi_value_option_takes_spaces_commas_or_repeats_in_any_mix():
    from refusion_cli.cli.bench import parse_batch_sizes

    spaced = parsed("bench", "--gen-length", "64", "128", "--batch-size", "1,8", "--decoder", "ar", "refusion")
    assert (spaced["gen_length"], spaced["batch_size"], spaced["decoder"]) == (["64", "128"], ["1", "8"],
                                                                             ["ar", "refusion"])
    for mix in (["--gen-length", "64,128", "--batch-size", "1", "8", "--decoder", "ar,refusion"],
                ["--gen-length", "64", "--gen-length", "128", "--batch-size=1,8", "-d", "ar", "-d", "refusion"]):
        assert {key: parsed("bench", *mix)[key] for key in ("gen_length", "batch_size", "decoder")} == {
            key: spaced[key] for key in ("gen_length", "batch_size", "decoder")}
    settings = bench_settings(MultiValues(spaced["decoder"], [], [], gen_lengths=spaced["gen_length"]), None,
                              device="cpu", batch_sizes=tuple(parse_batch_sizes(spaced["batch_size"])))
    assert (settings.gen_lengths, settings.batch_sizes, settings.decoders) == ((64, 128), (1, 8), ("ar", "refusion"))
    # the same rule for eval and chat
    evaluated = parsed("eval", "--task", "synthetic", "gsm8k", "--decoder", "refusion,ar", "--set", "slot_size=8",
                       "token_threshold=0.5", "--limit", "2")
    assert (evaluated["task"], evaluated["decoder"], evaluated["set_"], evaluated["limit"]) == (
        ["synthetic", "gsm8k"], ["refusion", "ar"], ["slot_size=8", "token_threshold=0.5"], 2)
    assert parsed("chat", "--set", "slot_size=8", "token_threshold=0.5")["set_options"] == [
        "slot_size=8", "token_threshold=0.5"]


def test_the_spread_stops_at_the_next_option_and_after_a_double_dash():
    from refusion_cli.cli.app import load_command
    from refusion_cli.cli.options import spread_values

    bench_params = load_command("bench").params
    assert spread_values(["--gen-length", "64", "--tps", "--seed", "3"], bench_params) == [
        "--gen-length", "64", "--tps", "--seed", "3"]
    assert spread_values(["--decoder", "", "--gen-length="], bench_params) == ["--decoder", "", "--gen-length", ""]
    assert spread_values(["--", "--decoder", "a", "b"], bench_params) == ["--", "--decoder", "a", "b"]


def test_bench_ablation_is_off_unless_asked_for():
    assert parsed("bench")["ablation"] is False
    assert parsed("bench", "--ablation")["ablation"] is True
