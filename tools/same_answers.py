"""Check that two `refusion eval` runs of the same benchmarks gave the same answers, sample by sample.

    python -m tools.same_answers results/synthetic-500-batch1 results/synthetic-500-batch16

For every journal file (benchmark, decoder:model) the two runs share, every document's output text,
token count and forward count must be equal; prints one line per file and exits 1 on any difference.
Used to show that ``--batch-size`` changes the timing of a run, never its answers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from refusion_cli.harness.journal import read_records

COMPARED = ("output", "tokens", "forwards", "score")


def answers(path: Path) -> dict[tuple[str, int], tuple]:
    """The last journaled record of each (subtask, document) in one journal file."""
    return {(r["subtask"], r["doc_id"]): tuple(r[key] for key in COMPARED) for r in read_records([path])}


def compare(first: Path, second: Path) -> list[str]:
    """One line per shared journal file; a line starting with 'DIFFERENT' for a mismatch."""
    lines = []
    files = sorted(p.relative_to(first / "samples") for p in (first / "samples").glob("*/*.jsonl"))
    for relative in files:
        other = second / "samples" / relative
        if not other.is_file():
            lines.append(f"DIFFERENT {relative}: missing from {second}")
            continue
        a, b = answers(first / "samples" / relative), answers(other)
        differing = sorted(key for key in a.keys() | b.keys() if a.get(key) != b.get(key))
        verdict = "same" if not differing else f"DIFFERENT in {len(differing)} (first: {differing[0]})"
        lines.append(f"{verdict}: {relative} ({len(a)} and {len(b)} samples)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    for run in (args.first, args.second):
        if not (run / "samples").is_dir():
            parser.error(f"{run} has no samples/ folder: not a refusion eval run")
    lines = compare(args.first, args.second)
    print("\n".join(lines))
    return 1 if not lines or any(line.startswith("DIFFERENT") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
