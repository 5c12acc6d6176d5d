"""LLaDA and Dream loaded natively give the logits and token ids of their authors' code.

The golden files (tests/standins/golden/) were made by tools/golden_logits.py: the authors' modelling
and tokenizer code under transformers 4.52.4, run on the stand-ins tools/standins.py builds (seed 0).
Here the same stand-ins load with the toolkit (LlamaForCausalLM / Qwen2ForCausalLM, no remote code)
and are called as the toolkit's decoders call them: explicit position ids, a 4-D mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from refusion_cli.decoding.cache import additive_mask
from refusion_cli.models import load_model
from tools.golden_logits import CHATS, FAMILIES, TEXTS, weights_fingerprint

GOLDEN = Path(__file__).parent / "golden"
TOLERANCE = 1e-4  # float32 rounding; the measured difference is 0 to 1e-6
CASES = ("single", "short", "padded_batch")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, standin) -> tuple[str, Path]:
    return request.param, standin(FAMILIES[request.param])


def test_the_golden_files_were_made_from_these_stand_ins(family):
    name, directory = family
    record = json.loads((GOLDEN / f"{name}.json").read_text())
    assert record["weights_sha256"] == weights_fingerprint(directory)
    assert record["transformers"].startswith("4.")  # the authors' code ran under the release it was written for
    assert record["model_class"] == {"llada": "LLaDAModelLM", "dream": "DreamModel"}[name]


def test_native_logits_equal_the_authors_code(family):
    name, directory = family
    golden = load_file(str(GOLDEN / f"{name}.safetensors"))
    loaded = load_model(str(directory), "cpu", torch.float32)
    assert type(loaded.model).__name__ == {"llada": "LlamaForCausalLM", "dream": "Qwen2ForCausalLM"}[name]
    columns = golden["columns"]
    for case in CASES:
        ids, padding = golden[f"{case}.input_ids"], golden[f"{case}.padding"]
        real = padding.bool()  # [B, T]
        seen = real[:, None, :].expand(-1, ids.shape[1], -1)  # every query sees the row's real tokens
        with torch.no_grad():
            logits = loaded.model(input_ids=ids, position_ids=golden[f"{case}.position_ids"],
                                  attention_mask=additive_mask(seen, torch.float32)).logits  # [B, T, V]
        difference = (logits[..., columns] - golden[f"{case}.logits"])[real].abs().max().item()
        assert difference <= TOLERANCE, (case, difference)
        assert torch.equal(logits.argmax(-1)[real], golden[f"{case}.argmax"][real]), case
        spread = (torch.logsumexp(logits, -1) - golden[f"{case}.logsumexp"])[real].abs().max().item()
        assert spread <= TOLERANCE, (case, spread)
    # the padded batch's second row is the short prompt alone, shifted right: a row never sees the padding
    assert torch.equal(golden["padded_batch.argmax"][1][golden["padded_batch.padding"][1].bool()],
                       golden["short.argmax"][0])


def test_native_tokenizers_give_the_authors_ids(family):
    name, directory = family
    record = json.loads((GOLDEN / f"{name}.json").read_text())
    tokenizer = load_model(str(directory), "cpu", torch.float32).tokenizer
    for text in TEXTS:
        assert list(tokenizer(text, add_special_tokens=False)["input_ids"]) == record["texts"][text], text
    for chat, ids in zip(CHATS, record["chats"]):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert list(tokenizer(text, add_special_tokens=False)["input_ids"]) == ids
