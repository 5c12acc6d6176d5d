"""Answer handling per protocol and decoder (``harness.answers``): end ids and the text a task receives."""

from __future__ import annotations

import pytest

from refusion_cli.harness.answers import STOCK, answer_rule, cut_at_stop, split_at_stops
from refusion_cli.harness.sandbox import isolation, package_folders, run_candidate
from tools.paper_answers import EOT, IM_END, IM_START, T, piece_ids


def text(qwen3, decoder: str, protocol: str, pieces, until=("Question:",)) -> str:
    return answer_rule(decoder, protocol).text(qwen3, piece_ids(qwen3, pieces), list(until))


def test_the_paper_rows_end_at_the_tokenizers_eos_only_and_lm_eval_at_every_end_id(qwen3):
    from types import SimpleNamespace

    loaded = SimpleNamespace(eos_token_id=151645, stop_token_ids=(151645, 151643))
    assert answer_rule("refusion", "paper").end_ids(loaded) == (151645,)
    assert answer_rule("ar", "paper").end_ids(loaded) == (151645,)
    for decoder in ("refusion", "ar", "llada", "dream"):
        assert answer_rule(decoder, "lm-eval") is STOCK and STOCK.end_ids(loaded) == (151645, 151643)
    assert answer_rule("llada", "paper").end_ids(loaded) == (151645, 151643)  # LLaDA's script: its own end tokens


def test_eval_py_removes_special_tokens_after_the_stop_strings(qwen3):
    split = [T("The answer is (B). Ques"), IM_START, T("tion: next"), IM_END]
    assert text(qwen3, "refusion", "paper", split) == "The answer is (B). Question: next"
    assert text(qwen3, "refusion", "lm-eval", split) == "The answer is (B). "
    spelled = [T("B<|endoftext|>."), IM_END]  # re-tokenised, the text becomes the special token and goes
    assert text(qwen3, "refusion", "paper", spelled) == "B." and text(qwen3, "ar", "lm-eval", spelled) == "B<|endoftext|>."


def test_eval_py_normalises_to_nfc_when_it_re_tokenises(qwen3):
    assert text(qwen3, "refusion", "paper", [T("(B\u0307)")]) == "(\u1e02)"
    assert text(qwen3, "refusion", "lm-eval", [T("(B\u0307)")]) == "(B\u0307)"


def test_dream_cuts_at_the_eos_text_and_keeps_other_special_tokens(qwen3):
    pieces = [T("The answer"), EOT, T(" is (C)."), IM_END, T(" rest")]
    assert text(qwen3, "dream", "paper", pieces) == "The answer<|endoftext|> is (C)."
    assert text(qwen3, "llada", "paper", pieces) == "The answer is (C). rest"
    assert text(qwen3, "dream-d2f", "paper", pieces) == text(qwen3, "dream-fast-dllm", "paper", pieces) == \
        "The answer<|endoftext|> is (C)."  # D2F's and Fast-dLLM's Dream scripts keep Dream's steps


def test_d2f_llada_drops_special_tokens_before_the_stop_strings(qwen3):
    split = [T("The answer is (B). Ques"), IM_START, T("tion: next"), IM_END]  # a stop split by a special token
    assert text(qwen3, "llada-d2f", "paper", split) == "The answer is (B). "  # D2F's eval_llada.py: found
    assert text(qwen3, "llada", "paper", split) == "The answer is (B). Question: next"  # LLaDA's: not found
    assert text(qwen3, "llada-fast-dllm", "paper", split) == text(qwen3, "llada", "paper", split)
    spelled = [T("B<|endoftext|>.")]  # special-token text stays: D2F's script does not re-tokenise
    assert text(qwen3, "llada-d2f", "paper", spelled) == "B<|endoftext|>."


def test_the_stop_strings_cut_in_the_tasks_order_or_at_the_earliest():
    stops = ["bc", "ab"]  # "ab" starts first but is found only after the cut at "bc"
    assert split_at_stops("xabc", stops) == "xa" and cut_at_stop("xabc", stops) == "x"
    assert split_at_stops("x", ["", "y"]) == "x" == cut_at_stop("x", ["", "y"])


def test_code_imports_the_evaluators_packages():
    assert run_candidate("import numpy as np\nassert int(np.arange(4).sum()) == 6\n", timeout=20).passed
    assert not run_candidate("import surely_not_an_installed_package\n", timeout=20).passed
    assert isolation().packages


def test_the_evaluators_packages_are_read_only_to_the_throwaway_user():
    if not isolation().throwaway_user:
        pytest.skip("candidates run as the evaluator's user here, as in a fork of the evaluator")
    import numpy

    target = f"{numpy.__path__[0]}/written-by-candidate"
    result = run_candidate(f"open({target!r}, 'w').write('x')\n", timeout=20)
    assert result.status == "failed" and ("PermissionError" in result.detail  # read-only binds in the jail
                                          or "Read-only file system" in result.detail)
    assert package_folders()
