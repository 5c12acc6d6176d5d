"""The draft-head probe: one teacher-forced pass equals the decoder's own situations, computed separately."""

from __future__ import annotations

import pytest
import torch

import json

from refusion_cli.decoding.refusion import StepTrace
from tests.tiny import MASK_ID, tiny_qwen3
from tools.probe import (ErrorAttribution, ProbeCounts, attribute, first_difference, head_predictions, main,
                         probe_layout)


def test_layout_lets_each_mask_see_only_the_prompt_and_the_response_before_it():
    positions, allowed = probe_layout(2, 3)
    assert positions.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert allowed[5].tolist() == [1, 1, 0, 0, 0, 1, 0, 0]  # the mask at position 2: prompt and itself
    assert allowed[7].tolist() == [1, 1, 1, 1, 0, 0, 0, 1]  # the mask at position 4: prompt, response[:2], itself
    assert allowed[:5, :5].equal(torch.ones(5, 5, dtype=torch.bool).tril())  # the clean part is plain causal
    assert not allowed[:5, 5:].any()  # no clean token sees a mask


def test_predictions_equal_separate_forwards_of_each_situation():
    model = tiny_qwen3(seed=3, init_std=0.3)
    prompt, response = [5, 9, 14], [20, 21, 7, 33, 40]
    ar, draft = head_predictions(model, prompt, response, MASK_ID)
    for i in range(len(response)):
        context = torch.tensor([prompt + response[:i]])
        with torch.no_grad():
            causal = model(input_ids=context).logits[0, -1].argmax()
            masked = model(input_ids=torch.cat([context, torch.tensor([[MASK_ID]])], 1)).logits[0, -1].argmax()
        assert int(ar[i]) == int(causal)  # what verification sees: the token before position i
        assert int(draft[i]) == int(masked)  # what the plan / completion step sees: a mask right after the prefix


def test_rates_and_bad_input():
    counts = ProbeCounts(positions=10, ar_correct=9, draft_correct=5, digits=4, ar_digits_correct=4,
                         draft_digits_correct=1)
    assert counts.rates() == {"ar": 0.9, "draft": 0.5, "ar_digits": 1.0, "draft_digits": 0.25}
    with pytest.raises(ValueError, match="non-empty"):
        head_predictions(tiny_qwen3(), [], [1], MASK_ID)


def test_cli_refuses_a_bad_limit_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--limit", "0"])
    assert exit_info.value.code == 2
    assert "--limit must be at least 1" in capsys.readouterr().err


GOOD = '{"question": "Q", "answer": "#### 2", "target": "2"}'


@pytest.mark.parametrize("args, content, message", [
    (["--data", "DIR"], None, "error: --data DIR does not exist or is not a file"),
    (["--data", "FILE"], "", "error: --data FILE holds no problems"),
    (["--data", "FILE"], "\n{oops\n" + GOOD, "error: --data FILE, line 2, is not valid JSON"),
    (["--data", "FILE"], "[1, 2]", "error: --data FILE, line 1, is not a JSON object"),
    (["--data", "FILE"], '{"question": "Q", "target": "2"}', "error: --data FILE, line 1, has no string field answer"),
    (["--data", "FILE"], b'{"question": "caf\xe9"}', "error: --data FILE is not UTF-8 text (byte 17)"),
    (["--output", "DIR"], None, "error: --output DIR is a directory; give a file name for the JSON"),
    (["--output", "FILE/rates.json"], "x", "error: --output FILE is a file, not a directory"),
    (["--errors", "--preset", "nope"], None, "error: unknown refusion preset 'nope'"),
    (["--errors", "--gen-length", "0"], None, "error: gen_length must be a positive integer, got 0"),
])
def test_cli_refuses_bad_input_in_one_line_before_any_model_runs(args, content, message, tmp_path, capsys):
    """Before, a malformed --data line, a missing field or an unwritable --output was a traceback (the last after
    every model had been probed), and a bad --errors setting stopped the run only after the first model's probe."""
    file = tmp_path / "data.jsonl"
    if content is not None:
        file.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = [arg.replace("DIR", str(tmp_path)).replace("FILE", str(file)) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--limit", "1"])
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and out.out == ""  # not even the table's header: nothing was probed
    assert len(out.err.splitlines()) == 1, out.err
    assert out.err.startswith(message.replace("DIR", str(tmp_path)).replace("FILE", str(file)))


def test_first_difference_counts_a_length_difference():
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1, 2], [1, 3]) == 1
    assert first_difference([1], [1, 2]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_attribution_finds_how_the_first_wrong_token_was_committed():
    # commit order: slot 0, then slot 2 (out of order), then slot 1
    trace = [StepTrace(0, "fast", [0], [0], 4, offsets=[0, 1, 2, 3], tokens=[], kinds=["first"] + ["verified"] * 3),
             StepTrace(0, "completion", [2], [2], 1, 1, offsets=[8, 9], tokens=[], kinds=["first", "forced"]),
             StepTrace(0, "fast", [1], [1], 4, offsets=[4, 5, 6, 7], tokens=[],
                       kinds=["first", "verified", "forced", "verified"])]
    reference = list(range(10, 20))
    counts = ErrorAttribution()
    attribute(reference[:6] + [99] + reference[7:], trace, reference, True, counts)  # offset 6: forced, left complete
    attribute(reference[:8] + [99, 19], trace, reference, True, counts)  # offset 8: a first token, 4-7 came later
    attribute(reference, trace, reference, False, counts)  # right: every token counted, none wrong
    attribute(reference[:5], trace[:1] + [StepTrace(0, "fast", [1], [1], 1, offsets=[4], tokens=[], kinds=["first"])],
              reference, True, counts)  # stopped early
    assert (counts.problems, counts.wrong, counts.first_wrong_gap) == (4, 3, 1)
    assert counts.first_wrong == {"forced": 1, "first": 1, "none (ends early)": 1}
    assert counts.committed == {"first": 10, "verified": 17, "forced": 4}
    assert counts.committed_wrong == {"forced": 1, "first": 1}


def test_cli_attributes_the_errors_of_the_embedded_model(tmp_path):
    out = tmp_path / "probe.json"
    main(["--limit", "3", "--errors", "--output", str(out)])
    errors = json.loads(out.read_text())["models"]["refusion-tiny"]["errors"]
    assert errors["problems"] == 3 and errors["preset"] == "synthetic_tiny"
    assert sum(errors["first_wrong"].values()) == errors["wrong"]
    assert errors["committed"]["first"] > 0 and errors["committed"]["verified"] > 0
    assert errors["tokens_per_forward"] > 1
    ablation = json.loads(out.read_text())["models"]["refusion-tiny"]["errors_causal_fix"]
    assert ablation["problems"] == 3 and "forced" not in ablation["committed"]
