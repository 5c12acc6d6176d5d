"""`tools.hf_compare`: a `refusion eval` AR run set beside lm-eval's own `hf` model on the same task definitions."""

from __future__ import annotations

import json

from refusion_cli.harness.runner import EvalOptions, run_eval
from tools.hf_compare import main as compare_main


def test_the_ar_decoder_gives_lm_eval_hf_models_responses_and_scores(tmp_path):
    run = tmp_path / "run"
    run_eval(EvalOptions(tasks=["synthetic"], decoders=["ar"], models=["ar-tiny"], output=run, limit=3, device="cpu"))
    compare_main(["--run", str(run), "--model", "ar-tiny", "--task", "synthetic", "--limit", "3",
                  "--output", str(tmp_path / "compare")])
    rows = json.loads((tmp_path / "compare" / "compare.json").read_text())["synthetic"]
    assert [(row["task"], row["doc_id"]) for row in rows] == [("synthetic", 0), ("synthetic", 1), ("synthetic", 2)]
    assert all(row["same_text"] and row["same_score"] for row in rows), rows
    assert all(row["output"].strip() and row["score"] == 1.0 for row in rows)  # ar-tiny answers these right
    summary = (tmp_path / "compare" / "compare.md").read_text()
    assert "| synthetic | 3 | 3 | 3 | 100.0 % / 100.0 % |" in summary and "Responses that differ: 0." in summary


def test_a_different_response_is_reported_with_where_it_starts():
    from tools.hf_compare import compare, markdown

    ours = {("gsm8k_cot", 0): {"output": "The answer is 12.", "score": 1.0, "tokens": 6}}
    theirs = {("gsm8k_cot", 0): {"resps": [["The answer is 13."]], "exact_match": 0.0}}
    rows = compare(ours, theirs, "exact_match")
    assert rows[0]["same_text"] is False and rows[0]["same_score"] is False and rows[0]["first_difference"] == 15
    text = markdown({"gsm8k": rows}, "paper")
    assert "| gsm8k | 1 | 0 | 0 | 100.0 % / 0.0 % |" in text and "first difference at character 15" in text
