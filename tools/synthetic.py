"""Write the synthetic task's splits: the held-out test set and a train set that shares no question with it.

    python -m tools.synthetic --out evals/synthetic --n-train 50000 --n-test 500 --seed 0 \\
        --train-out build/synthetic/train.jsonl

The problems and the split rule are ``refusion_cli.tasks.synthetic``'s (``write_splits``); this script
checks the command line's values first, so a bad count or folder is one ``error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from refusion_cli.cli.output import fail
from refusion_cli.errors import UserError
from refusion_cli.paths import check_output_dir
from refusion_cli.tasks.synthetic import write_splits


def check_split_options(out: str, n_train: int, n_test: int, train_out: str | None) -> None:
    """The command line's values: whole numbers of problems, and folders files can be written to."""
    for option, count in (("--n-train", n_train), ("--n-test", n_test)):
        if count < 0:
            raise UserError(f"{option} must be 0 or more, got {count}")
    for option, path in (("--out", out), ("--train-out", train_out)):
        if path is not None and not path.strip():  # Path("") would be the working directory
            raise UserError(f"{option} is empty")
    check_output_dir(Path(out), hint="give --out a folder for test.jsonl", option="--out")
    if train_out is not None:
        if Path(train_out).is_dir():
            raise UserError(f"--train-out {train_out} is a directory; give the file name of the train split")
        check_output_dir(Path(train_out).parent, hint="give --train-out a file in a folder you can write to",
                         option="--train-out")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.synthetic",
                                     description="Write the synthetic GSM8K-format train / held-out splits.")
    parser.add_argument("--out", required=True, help="folder for test.jsonl")
    parser.add_argument("--n-train", type=int, default=50_000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-out", default=None,
                        help="where the train set goes (default: <out>/train.jsonl, not committed)")
    args = parser.parse_args(argv)
    try:
        check_split_options(args.out, args.n_train, args.n_test, args.train_out)
    except UserError as exc:
        fail(str(exc), exc.hint)
    train_file, test_file = write_splits(args.out, args.n_train, args.n_test, args.seed, args.train_out)
    print(f"wrote {args.n_train} train problems to {train_file} and {args.n_test} test problems to {test_file}")


if __name__ == "__main__":
    main()
