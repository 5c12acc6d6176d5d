"""The tiny models' tokenizer: trained on a small synthetic corpus in a temporary folder, loaded back
with AutoTokenizer, checked for round-trips, special tokens, digits and the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from refusion_cli.tasks.synthetic import generate_problems, read_jsonl
from refusion_cli.tasks.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    IM_START,
    MASK_TOKEN,
    PAD_TOKEN,
    corpus_texts,
    train_tokenizer,
)

COMMITTED_TEST = Path(__file__).resolve().parents[2] / "evals" / "synthetic" / "test.jsonl"
MIN_RESPONSE_TOKENS = 48  # parallel decoding needs long responses


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(corpus_texts(generate_problems(2000, seed=1)))


@pytest.fixture(scope="module")
def tokenizer_dir(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(corpus, DEFAULT_VOCAB_SIZE, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def test_training_is_deterministic(corpus: list[str], tokenizer_dir: Path, tmp_path: Path) -> None:
    train_tokenizer(corpus, DEFAULT_VOCAB_SIZE, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tokenizer_dir / name).read_bytes()


def test_vocab_is_small_and_bounded(tokenizer) -> None:
    assert 400 <= len(tokenizer) <= DEFAULT_VOCAB_SIZE


@pytest.mark.parametrize("text", [
    "Mia has 12 apples. She buys 7 more apples.",
    "Mia starts with 12 apples.\nShe buys 7 more, so 12 + 7 = 19.\n#### 19",
    "  leading and trailing spaces,\ttabs\n\n and blank lines  ",
    "Unicode: héllo wörld, naïve café, 数学, emoji 😀, math ∑ x² ≤ 1,234.50",
    "Words it never saw: quasar, zephyr, xylophone.",
    "",
])
def test_decode_inverts_encode(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN)]
    assert len(set(ids)) == 4 and tokenizer.unk_token_id not in ids
    for token, token_id in zip((PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN), ids):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.mask_token) == (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id) == (ids[2], ids[0], ids[3])
    text = f"a{MASK_TOKEN}{MASK_TOKEN}b{EOS_TOKEN}"
    assert tokenizer.encode(text, add_special_tokens=False).count(ids[3]) == 2
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_encode_adds_no_tokens(tokenizer) -> None:
    assert tokenizer("12")["input_ids"] == tokenizer.encode("12", add_special_tokens=False)


def test_digits_are_tokenized_individually(tokenizer) -> None:
    text = "In 2024, 1,234 + 56789 = 58023 and 7 * 19 = 133."
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
    digit_tokens = [token for token in tokens if any(char.isdigit() for char in token)]
    assert all(len(token) == 1 for token in digit_tokens)
    assert "".join(digit_tokens) == "".join(char for char in text if char.isdigit())


def test_chat_template_two_turns(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Mia has 3 apples. How many apples does Mia have now?"},
        {"role": "assistant", "content": "Mia starts with 3 apples.\n#### 3"},
    ]
    expected = ("<|im_start|>user\nMia has 3 apples. How many apples does Mia have now?<|im_end|>\n"
                "<|im_start|>assistant\nMia starts with 3 apples.\n#### 3<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    assert tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False) == expected


def test_chat_template_generation_prompt(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == expected
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(ids) == tokenizer.encode(expected, add_special_tokens=False)


def test_held_out_responses_are_long(tokenizer) -> None:
    lengths = [len(tokenizer.encode(row["answer"], add_special_tokens=False)) for row in read_jsonl(COMMITTED_TEST)]
    assert len(lengths) == 500
    assert min(lengths) >= MIN_RESPONSE_TOKENS


def test_too_small_vocab_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["Mia has 3 apples."], 100, tmp_path)
