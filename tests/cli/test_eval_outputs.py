"""Where eval and bench write without --output (a new folder under runs/, never a tracked file), a rerun into a
folder with other settings refused, and one default config per decoder and model in every command."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refusion_cli.cli.bench import bench_settings
from refusion_cli.cli.chat import chat_choice
from refusion_cli.cli.options import MultiValues
from refusion_cli.bench.runner import plan_entries
from refusion_cli.chat.session import chat_config
from refusion_cli.decoding.spec import default_config, parse_decoder_options, preset_config
from refusion_cli.harness.runner import EvalOptions, plan_eval
from refusion_cli.paths import fresh_run_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A clone of this repository's HEAD (its objects shared): a checkout where a user runs the commands, and
    where nobody else edits files while a test looks at its git status."""
    clone = tmp_path_factory.mktemp("checkout") / "refusion"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(clone)], check=True)
    return clone


def git_status(root: Path) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True,
                         text=True, check=True)
    return out.stdout.splitlines()


def refusion(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``refusion ARGS`` in this process: exit code, stdout, stderr."""
    from refusion_cli.cli.app import main

    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["refusion", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.parametrize("args", [
    ("eval", "--task", "synthetic", "--decoder", "refusion", "--limit", "2", "--set", "gen_length=32"),
    ("bench", "--decoder", "refusion", "--limit", "2", "--gen-length", "32"),
], ids=["eval", "bench"])
def test_a_run_without_output_writes_a_new_folder_under_runs_and_no_tracked_file(args, checkout, monkeypatch,
                                                                                capsys):
    monkeypatch.chdir(checkout)  # where a user runs it
    assert git_status(checkout) == []
    code, out, err = refusion(monkeypatch, capsys, *args)
    assert code == 0, err
    folder = checkout / re.search(r"writing to (runs/\S+)/", out).group(1)
    assert folder.parent == checkout / "runs" and folder.name.startswith(f"{args[0]}-") and any(folder.iterdir())
    assert git_status(checkout) == []  # nothing tracked changed, nothing untracked appeared (runs/ is ignored)


def test_each_run_without_output_gets_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    when = dt.datetime(2026, 1, 2, 3, 4, 5)
    first = fresh_run_dir("eval", when)
    assert first == Path("runs/eval-20260102-030405")
    first.mkdir(parents=True)
    assert fresh_run_dir("eval", when) == Path("runs/eval-20260102-030405-2")  # a run in the same second


def test_a_rerun_into_a_folder_with_other_set_values_is_refused_and_changes_nothing(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    common = ("eval", "--task", "synthetic", "--decoder", "refusion", "--limit", "2", "--output", str(run_dir))
    code, _, err = refusion(monkeypatch, capsys, *common, "--set", "gen_length=16")
    assert code == 0, err
    before = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    code, out, err = refusion(monkeypatch, capsys, *common, "--set", "gen_length=16", "--set", "slot_size=8")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert (f"error: --output {run_dir} holds refusion:refusion-tiny on synthetic with other settings (slot_size 4 "
            "there, 8 here); a folder keeps one setting per row") in " ".join(err.split())
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == before
    [cell] = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert (cell["label"], cell["settings"], cell["seed"]) == (
        "refusion:refusion-tiny", "gen_length=16 slot_size=4 block_size=32", 0)
    code, out, err = refusion(monkeypatch, capsys, *common, "--set", "gen_length=16", "--seed", "1")
    assert code == 2 and "seed 0 there, 1 here" in " ".join(err.split())


def test_refusion_tiny_starts_from_its_own_preset_in_every_command(tmp_path):
    """No --preset, no --set: eval, bench, chat and serve give ReFusion on refusion-tiny synthetic_tiny's k, b and
    thresholds (spec.default_config); on another model the decoder's own defaults."""
    tiny = default_config("refusion", "refusion-tiny", 64)
    assert tiny == preset_config("synthetic_tiny").__class__(**{**vars(preset_config("synthetic_tiny")),
                                                              "gen_length": 64})
    plan = plan_eval(EvalOptions(tasks=["synthetic"], decoders=["refusion"], output=tmp_path / "run", limit=0,
                                 device="cpu", overrides=["gen_length=64"]))
    [bench] = [entry.config for entry in plan_entries(bench_settings(
        MultiValues(["refusion"], [], [], gen_lengths=["64"]), None, device="cpu", ablation=False))]
    chat = chat_config("refusion", {"gen_length": 64}, None, chat_choice("refusion", None, [], None).checkpoint)
    [served] = parse_decoder_options(["refusion"], [], [])  # what refusion serve builds its configs from
    assert plan.configs[("synthetic", "refusion:refusion-tiny")] == bench == chat == served.config(64) == tiny
    from refusion_cli.harness.model_args import decoder_choice  # refusion lm-eval's model_args, pretrained= or not

    assert decoder_choice("refusion", None, {}, "refusion-tiny").config(64) == tiny
    other = default_config("refusion", "/models/ReFusion", 64)
    assert (other.slot_size, other.block_size) == (8, None)  # the paper's defaults
