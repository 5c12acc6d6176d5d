"""Train the small byte-level BPE tokenizer of the embedded tiny models.

Contract of ``train_tokenizer(texts, vocab_size, out_dir)``:

- Byte-level BPE (``tokenizers``): every string round-trips, ``decode(encode(x)) == x``. All 256
  byte symbols are in the vocabulary whatever the corpus holds.
- Pre-tokenization splits every digit on its own (``Digits(individual_digits=True)``) before the
  GPT-2 style byte-level split, so a number is always a sequence of one-digit tokens.
- The special tokens are Qwen3's ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos)
  and ReFusion's ``<|mask|>`` (mask), each a single id, never split or merged. Their ids are
  whatever the trainer assigns; read them from the tokenizer, never hard-code them.
- The chat template is Qwen3's without the thinking block: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
  per message and ``<|im_start|>assistant\\n`` when ``add_generation_prompt=True``. Extra template
  variables (``enable_thinking=False``, ``tools=None``, ...) are accepted and ignored.
- The result is a transformers ``PreTrainedTokenizerFast`` saved with ``save_pretrained`` to
  ``out_dir``; ``AutoTokenizer.from_pretrained(out_dir)`` loads it offline. Training is
  deterministic: the same texts and vocab size give the same files.

CLI: ``python -m refusion_cli.tasks.tokenizer --data <train.jsonl> --out <dir> [--vocab-size N]``
trains on the chat turns (``chat_texts``) of a JSONL file in any format ``refusion train`` reads.
On that corpus the merges run out at about 460 tokens: any ``--vocab-size`` above that gives the same
tokenizer, so read the size from ``len(tokenizer)``, never from the argument.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 512
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())  # every byte has a token
MAX_VOCAB_SIZE = 1_000_000  # far above any merge count a corpus here reaches; ~2**31 makes the trainer abort

# Qwen3's template reduced to its message framing: no system-prompt default, no tools, no <think>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_backend(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """The raw ``tokenizers`` BPE model trained on ``texts``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (special tokens + 256 bytes), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around ``backend`` with Qwen3's special tokens and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must give back the exact text
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train on ``texts``, save to ``out_dir`` with ``save_pretrained`` and return the tokenizer."""
    tokenizer = wrap(build_backend(texts, vocab_size))
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def corpus_texts(rows: Iterable[dict[str, str]]) -> Iterable[str]:
    """The training texts of a synthetic split (``question`` / ``answer`` rows); see :func:`chat_texts`."""
    return chat_texts((row["question"], row["answer"]) for row in rows)


def chat_texts(pairs: Iterable[tuple[str, str]]) -> Iterable[str]:
    """Each (prompt, response) as the chat template lays its turns out between its special tokens
    ("user\\n<prompt>", "assistant\\n<response>"), so the role names get merged too. The special
    tokens themselves stay out: the trainer would learn merges of their bytes."""
    for prompt, response in pairs:
        yield f"user\n{prompt}"
        yield f"assistant\n{response}"


def main(argv: list[str] | None = None) -> None:
    from refusion_cli.cli.output import fail
    from refusion_cli.errors import UserError
    from refusion_cli.paths import check_output_dir
    from refusion_cli.training.data import read_records

    parser = argparse.ArgumentParser(prog="python -m refusion_cli.tasks.tokenizer",
                                     description="Train the byte-level BPE tokenizer of the tiny models.")
    parser.add_argument("--data", required=True, type=Path, help="JSONL of {query, response}, {prompt, completion} "
                        "or {question, answer} records (what refusion train reads)")
    parser.add_argument("--out", required=True, help="folder for the tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    try:
        if not MIN_VOCAB_SIZE <= args.vocab_size <= MAX_VOCAB_SIZE:
            raise UserError(f"--vocab-size must be from {MIN_VOCAB_SIZE} (the special tokens and 256 bytes) to "
                            f"{MAX_VOCAB_SIZE:,}, got {args.vocab_size}")
        if not args.out.strip():  # Path("") would be the working directory
            raise UserError("--out is empty", hint="give the folder for the tokenizer files")
        check_output_dir(Path(args.out), hint="give --out a folder for the tokenizer files", option="--out")
        records = read_records(args.data)
        if not records:
            raise UserError(f"{args.data} holds no records")
    except UserError as exc:
        fail(str(exc), exc.hint)
    tokenizer = train_tokenizer(chat_texts((r.prompt, r.response) for r in records), args.vocab_size, args.out)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
