"""The LLaDA and Dream decoders' Fast-dLLM options give, token for token, what Fast-dLLM's own samplers give.

tests/standins/golden/fastdllm.json was made by tools/golden_fastdllm.py (its docstring has the command):
Fast-dLLM's LLaDA generators and Dream samplers, greedy, on the stand-ins tools/standins.py builds (seed 0),
three prompts under twelve settings per family (no cache, prefix cache, dual cache; threshold 0.9, a low
threshold, threshold 0, a fixed number of steps). Here the same stand-ins load natively (LlamaForCausalLM,
Qwen2ForCausalLM) and decode with the toolkit's configs of the recorded fields: each response (whole, no EOS
cut) and its number of model calls equal the golden ones. The fast tests run a share of the cases alone and a
share as batches; the slow one runs every case alone and every setting as one batch of its three prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from refusion_cli.decoding import DreamConfig, LLaDAConfig, run_decoder
from refusion_cli.models import load_model
from tools.golden_fastdllm import FAMILIES
from tools.golden_logits import weights_fingerprint

GOLDEN = Path(__file__).parent / "golden" / "fastdllm.json"
CONFIG_CLASSES = {"llada": LLaDAConfig, "dream": DreamConfig}  # the decoder of each family
# the fast share: every cache mode at threshold 0 (a full pass that finishes its block, Dream's cap on
# tokens a step) and Dream's capped threshold alone; the low threshold of both caches and the dual cache's
# fixed steps as batches
FAST_ALONE = {"none/threshold-0", "prefix/threshold-0", "dual/threshold-0"}
FAST_ALONE_DREAM = {"none/threshold-low"}
FAST_BATCHED = {"prefix/threshold-low", "dual/threshold-low", "dual/fixed"}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@dataclass(frozen=True)
class Family:
    name: str  # llada or dream
    directory: Path  # its stand-in
    loaded: Any  # the stand-in's native load (refusion_cli.models.LoadedModel)
    record: dict  # its part of the golden file


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, standin, golden) -> Family:
    directory = standin(FAMILIES[request.param])
    return Family(request.param, directory, load_model(str(directory), "cpu", torch.float32),
                  golden["families"][request.param])


def settings_of(record: dict) -> dict[str, list[dict]]:
    """setting name -> its cases, in prompt order."""
    grouped: dict[str, list[dict]] = {}
    for case in record["cases"]:
        grouped.setdefault(case["setting"], []).append(case)
    return grouped


def decode(family: Family, cases: list[dict], batched: bool) -> list:
    """The toolkit's results for ``cases`` (one setting): alone, or all in one batch."""
    config = CONFIG_CLASSES[family.name](**cases[0]["config"])
    prompts = [family.record["prompts"][case["prompt"]] for case in cases]
    model, ids = family.loaded.model, dict(mask_token_id=family.loaded.mask_token_id, eos_token_id=None)
    if batched:
        return run_decoder(family.name, model, prompts, config, **ids)
    return [run_decoder(family.name, model, prompt, config, **ids) for prompt in prompts]


def assert_equal(results: list, cases: list[dict]) -> None:
    for result, case in zip(results, cases, strict=True):
        where = (case["setting"], case["prompt"])
        assert result.tokens == case["tokens"], where
        assert result.stats.forwards == case["model_calls"], where


def test_the_golden_file_was_made_from_these_stand_ins_by_fast_dllm(family):
    record = family.record
    assert record["weights_sha256"] == weights_fingerprint(family.directory)
    assert record["model_class"] == {"llada": "LLaDAModelLM", "dream": "DreamModel"}[family.name]
    grouped = settings_of(record)
    assert len(grouped) == 12 and all(len(cases) == 3 for cases in grouped.values())
    assert len({len(prompt) for prompt in record["prompts"]}) == 3  # three prompt lengths
    gen_length = record["cases"][0]["config"]["gen_length"]
    for setting in ("none/threshold-low", "prefix/threshold-low", "dual/threshold-low"):
        assert min(case["model_calls"] for case in grouped[setting]) < gen_length, setting  # several tokens a step
    # a block that its full pass finished still takes a cached step: two calls a block
    assert {case["model_calls"] for case in grouped["prefix/threshold-0"]} == {2 * gen_length // 8}


def test_token_for_token_with_fast_dllm(family):
    for setting, cases in settings_of(family.record).items():
        if setting in FAST_ALONE or (family.name == "dream" and setting in FAST_ALONE_DREAM):
            assert_equal(decode(family, cases, batched=False), cases)
        if setting in FAST_BATCHED:
            assert_equal(decode(family, cases, batched=True), cases)


@pytest.mark.slow
def test_every_golden_case_alone_and_every_setting_batched(family):
    for cases in settings_of(family.record).values():
        assert_equal(decode(family, cases, batched=False), cases)
        assert_equal(decode(family, cases, batched=True), cases)
