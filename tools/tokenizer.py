"""Train the tiny models' byte-level BPE tokenizer on a JSON-lines file.

    python -m tools.tokenizer --data <train.jsonl> --out <dir> [--vocab-size N]

It trains ``refusion_cli.tasks.tokenizer.train_tokenizer`` on the chat turns (``chat_texts``) of a
file in any format ``refusion train`` reads. On the synthetic corpus the merges run out at about 460
tokens: any ``--vocab-size`` above that gives the same tokenizer. A bad size, folder or file is one
``error:`` line and exit 2, before anything is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from refusion_cli.cli.output import fail
from refusion_cli.errors import UserError
from refusion_cli.paths import check_output_dir
from refusion_cli.tasks.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE, chat_texts, train_tokenizer
from refusion_cli.training.data import read_records

MAX_VOCAB_SIZE = 1_000_000  # far above any merge count a corpus here reaches; ~2**31 makes the trainer abort


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.tokenizer",
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
