"""D2F through the toolkit (native LLaDA / Dream load, the LoRA adapter put in by peft, llada-d2f / dream-d2f)
gives the tokens of D2F's own code.

tests/standins/golden/d2f.json was made by tools/golden_d2f.py: D2F's model classes with the stand-in adapters
loaded by peft 0.17's ``PeftModel.from_pretrained``, and D2F's ``_generate_block_single``, under transformers
4.49, on the stand-ins tools/standins.py builds (seed 0). Every case is compared token for token (the response
up to its first EOS, as the toolkit returns it; the authors' code leaves every position of the blocks it
added), call for call (the response offsets each model call committed) and in the cache's steps, alone and as
a batch. The gsm8k cases (one token a step over 128 / 96 positions) run one prompt by default, and the batches
of gsm8k and parallel-wide only with ``-m slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from refusion_cli.decoding.d2f import D2FConfig
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.stats import cut_after_eos
from refusion_cli.models import load_model
from tools.golden_logits import weights_fingerprint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "d2f.json").read_text())
STANDINS = {"llada": ("llada-8b-instruct", "d2f-llada-lora"), "dream": ("dream-v0-instruct-7b", "d2f-dream-lora")}
SLOW_CASES = {"gsm8k"}  # one token a step: over a hundred steps a prompt
SLOW_BATCHES = SLOW_CASES | {"parallel-wide"}  # its rows' lengths differ most: 2 s of padding


def config_of(case: dict) -> D2FConfig:
    settings = case["settings"]
    return D2FConfig(gen_length=settings["max_new_tokens"], block_size=settings["block_size"],
                     block_add_threshold=settings["block_add_threshold"],
                     decoded_token_threshold=settings["decoded_token_threshold"],
                     skip_threshold=settings["skip_threshold"])


def steps_of(result) -> list[list[int]]:
    """The response offsets each model call committed, sorted (as the golden file derives them)."""
    steps: list[list[int]] = [[] for _ in range(result.stats.forwards)]
    for record in result.trace:
        steps[record.step] += record.offsets
    return [sorted(offsets) for offsets in steps]


def runs() -> list:
    params = []
    for index, case in enumerate(GOLDEN["cases"]):
        for prompt in range(len(case["runs"])):
            slow = case["name"] in SLOW_CASES and (case["family"], prompt) != ("llada", 0)
            params.append(pytest.param(index, prompt, id=f"{case['family']}-{case['name']}-{prompt}",
                                       marks=[pytest.mark.slow] if slow else []))
    return params


def cases() -> list:
    return [pytest.param(index, id=f"{case['family']}-{case['name']}",
                         marks=[pytest.mark.slow] if case["name"] in SLOW_BATCHES else [])
            for index, case in enumerate(GOLDEN["cases"])]


@pytest.fixture(scope="module")
def loaded(standin):
    """family -> the stand-in base with its adapter, loaded as --model BASE+ADAPTER."""
    return {family: load_model(f"{standin(base)}+{standin(adapter)}", "cpu", torch.float32)
            for family, (base, adapter) in STANDINS.items()}


def decode(loaded, case: dict, prompts):
    model = loaded[case["family"]]
    return run_decoder(f"{case['family']}-d2f", model.model, prompts, config_of(case),
                       mask_token_id=model.mask_token_id, eos_token_id=case["eos_token_id"])


def test_the_golden_file_was_made_from_these_stand_ins(standin, loaded):
    for family, (base, adapter) in STANDINS.items():
        record = GOLDEN["families"][family]
        assert record["base_sha256"] == weights_fingerprint(standin(base))
        assert record["adapter_sha256"] == weights_fingerprint(standin(adapter))
        assert record["model_class"] == {"llada": "LLaDAModelLM", "dream": "DreamModel"}[family]
        assert (record["mask_token_id"], record["eos_token_id"]) == (loaded[family].mask_token_id,
                                                                     loaded[family].eos_token_id)
    assert (GOLDEN["transformers"], GOLDEN["peft"]) == ("4.49.0", "0.17.0")  # D2F's pins


def test_the_cases_reach_every_rule():
    """Parallel commits, several blocks at once, blocks cached together, an EOS that stops new blocks."""
    runs_of = {(case["family"], case["name"]): case["runs"] for case in GOLDEN["cases"]}
    for family in STANDINS:
        parallel = runs_of[(family, "parallel")]
        assert max(len(step) for run in parallel for step in run["steps"]) > 4
        assert any(kept > 8 for run in parallel for kept in run["cached"])  # several 8-token blocks in one call
    for run in runs_of[("dream", "eos")]:
        eos = 51814
        assert eos in run["response"] and len(run["response"]) < 64  # fewer blocks than the budget's eight
    for family in STANDINS:
        assert all(len(step) <= 2 for run in runs_of[(family, "gsm8k")] for step in run["steps"])


@pytest.mark.parametrize("index, prompt", runs())
def test_each_case_alone_gives_the_authors_tokens(loaded, index, prompt):
    case = GOLDEN["cases"][index]
    golden = case["runs"][prompt]
    result = decode(loaded, case, golden["prompt"])
    assert result.tokens == cut_after_eos(golden["response"], case["eos_token_id"])
    assert steps_of(result) == golden["steps"]
    assert result.stats.forwards == len(golden["cached"])


@pytest.mark.parametrize("index", cases())
def test_each_case_as_a_batch_gives_the_authors_tokens(loaded, index):
    case = GOLDEN["cases"][index]
    results = decode(loaded, case, [run["prompt"] for run in case["runs"]])
    for result, golden in zip(results, case["runs"], strict=True):
        assert result.tokens == cut_after_eos(golden["response"], case["eos_token_id"])
        assert steps_of(result) == golden["steps"]
