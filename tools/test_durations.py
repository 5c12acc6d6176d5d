"""Seconds per test file of a full run, from pytest's JUnit XML, into ``tests/durations.json``: under xdist the
suite hands its files to the workers longest first (``tests/conftest.py``), so that a long file is not left for
the end while the other worker idles.

    python -m pytest -n 2 --dist loadfile --junitxml build/junit.xml
    python -m tools.test_durations build/junit.xml [--out tests/durations.json]

A test's time in the XML holds its setup and teardown, so a module fixture counts for the file that builds it.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def file_of(classname: str, root: Path = REPO) -> str:
    """The test file of a JUnit classname (``tests.bench.test_bench_cli``, or with a class after the module)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (root / path).is_file():
            return path
    raise ValueError(f"no test file for {classname!r}")


def durations(junit: Path, root: Path = REPO) -> dict[str, float]:
    """Seconds per test file, rounded to 0.1 s, longest first."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        seconds[file_of(case.get("classname", ""), root)] += float(case.get("time", 0))
    return {path: round(value, 1) for path, value in sorted(seconds.items(), key=lambda item: -item[1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, help="pytest's --junitxml file of a full run")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "durations.json")
    args = parser.parse_args(argv)
    if not args.junit.is_file():
        parser.error(f"no such file: {args.junit}")
    found = durations(args.junit)
    args.out.write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
    print(f"{len(found)} files, {sum(found.values()):.0f} s in all -> {args.out}")


if __name__ == "__main__":
    main()
