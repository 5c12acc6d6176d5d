"""The tiny models' tokenizer: trained on a small synthetic corpus in a temporary folder, loaded back
with AutoTokenizer, checked for round-trips, special tokens, digits and the chat template."""

from __future__ import annotations

import json
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
    main,
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


def test_cli_trains_from_a_jsonl_file(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in generate_problems(200, seed=2)), encoding="utf-8")
    main(["--data", str(data), "--out", str(tmp_path / "tok"), "--vocab-size", "300"])
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(loaded) == 300
    assert loaded.eos_token == EOS_TOKEN


def test_cli_reads_every_training_record_format_and_names_a_bad_line(tmp_path: Path, capsys) -> None:
    rows = generate_problems(100, seed=3)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"query": r["question"], "response": r["answer"]}) + "\n" for r in rows[:50])
                    + "".join(json.dumps({"prompt": r["question"], "completion": r["answer"]}) + "\n"
                              for r in rows[50:]), encoding="utf-8")
    main(["--data", str(data), "--out", str(tmp_path / "tok"), "--vocab-size", "300"])
    same = tmp_path / "same.jsonl"  # the same records as question / answer give the same tokenizer
    same.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    main(["--data", str(same), "--out", str(tmp_path / "tok2"), "--vocab-size", "300"])
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (tmp_path / "tok2" / "tokenizer.json").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "response": "r"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(bad), "--out", str(tmp_path / "tok3")])
    assert exit_info.value.code == 2 and not (tmp_path / "tok3").exists()
    assert capsys.readouterr().err.startswith(f"error: {bad}, line 2, has none of the record formats")


@pytest.mark.parametrize("args, message", [
    (["--vocab-size", "10"], "error: --vocab-size must be from 260 (the special tokens and 256 bytes) to 1,000,000, "
                             "got 10"),
    (["--vocab-size", "1000000000000"], "error: --vocab-size must be from 260"),  # the trainer aborted the process
    (["--out", ""], "error: --out is empty"),  # not the working directory
    (["--out", "FILE"], "error: --out FILE is a file, not a directory"),  # transformers logged it and exited 0
    (["--out", "FILE/tok"], "error: --out FILE/tok cannot be created: FILE is a file, not a directory"),
])
def test_cli_refuses_a_bad_size_or_folder_in_one_line(args, message, tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in generate_problems(5, seed=2)), encoding="utf-8")
    file = tmp_path / "a_file"
    file.write_text("keep")
    args = [arg.replace("FILE", str(file)) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(data), "--out", str(tmp_path / "tok"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(message.replace("FILE", str(file)))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "train.jsonl"]  # nothing written
