"""A word-level chat tokenizer and toy JSONL data for the training tests (no hub, no real tokenizer), and
`refusion train` run in-process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MASK = "<|mask|>"
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = ["user", "assistant", "what", "is", "plus", "minus", "the", "answer", "so", "?", ".", "[UNK]"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tiny model the CLI tests build with --init tiny --model-config (fast on 2 CPU cores).
MICRO_CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 128}


def make_tokenizer(with_mask: bool = True) -> PreTrainedTokenizerFast:
    tokens = SPECIALS + ([MASK] if with_mask else []) + NUMBERS + WORDS
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    extra = ["<|im_start|>"] + ([MASK] if with_mask else [])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="[UNK]", additional_special_tokens=extra)
    tokenizer.chat_template = CHAT_TEMPLATE
    if with_mask:
        tokenizer.mask_token = MASK
    return tokenizer


def save_tokenizer(directory: Path, with_mask: bool = True) -> Path:
    make_tokenizer(with_mask).save_pretrained(directory)
    return directory


def arithmetic_records(count: int) -> list[dict[str, str]]:
    records = []
    for i in range(count):
        a, b = i % 5, (i * 3) % 5
        query = f"what is {NUMBERS[a]} plus {NUMBERS[b]} ?"
        response = f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]} . so the answer is {NUMBERS[a + b]} ."
        records.append({"query": query, "response": response})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """Run `refusion <args>` in this process; return (exit code, stdout, stderr)."""
    from refusion_cli.cli.app import main

    monkeypatch.setenv("COLUMNS", "500")  # keep Rich from wrapping the one-line messages
    monkeypatch.setattr(sys, "argv", ["refusion", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]
