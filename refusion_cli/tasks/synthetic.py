"""A seeded generator of GSM8K-format arithmetic word problems, small enough to learn on a CPU.

Contract:

- ``generate_problems(n, seed)`` returns ``n`` distinct problems (dicts with ``question``,
  ``answer``, ``target``); the same ``(n, seed)`` always gives the same list, and a longer list
  starts with the shorter one. The RNG is a private ``random.Random(seed)``, never the global one.
- A question is a short story: a person starts with some items, then 3 to 5 operations change
  the count (buy / find / receive add, give / sell / lose subtract, bags add a product, doubling
  or tripling multiplies). Operands are below 20 (the starting count is below 41) and every
  intermediate count stays in 1..99.
- The answer restates every operation with its numbers, one line each, each carrying an explicit
  ``a op b = c`` expression (``+``, ``-``, ``*``), and ends in the GSM8K line ``#### <number>``.
  ``target`` is that number as a string.
- ``extract_answer`` reads a number the GSM8K way (after the last ``####``, else the last number
  in the text, commas stripped); ``is_correct`` compares it with a target.
- ``write_splits`` writes a held-out test set drawn from its own seed and a train set that shares
  no question with it. The test set depends only on ``(n_test, seed)``, never on ``n_train``.

Regenerate the committed held-out set (``evals/synthetic/test.jsonl``) from the repository root::

    python -m tools.synthetic --out evals/synthetic --n-train 50000 --n-test 500 --seed 0 \\
        --train-out build/synthetic/train.jsonl
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

FEMALE_NAMES = ("Mia", "Emma", "Lily", "Zoe", "Ava", "Nora", "Ruby", "Ella")
MALE_NAMES = ("Leo", "Sam", "Max", "Ben", "Tom", "Jack", "Noah", "Owen")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells",
         "stamps", "coins", "cards", "books", "balloons", "flowers")

START_RANGE = (5, 40)  # the starting count is copied from the question, never computed
OPERAND_RANGE = (2, 19)  # added / subtracted amounts
BAG_COUNT_RANGE = (2, 5)  # "buys k bags with m items in each bag"
BAG_SIZE_RANGE = (2, 9)
MAX_COUNT = 99  # every intermediate count stays in 1..MAX_COUNT
MAX_MULTIPLICAND = 19  # doubling / tripling only applies to counts below 20
STEPS_RANGE = (3, 5)  # operations per problem
TEST_SEED_OFFSET = 1_000_003  # the held-out split draws from seed + offset

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Person:
    name: str
    subject: str  # "She" / "He"
    object: str  # "her" / "him"
    possessive: str  # "her" / "his"


@dataclass(frozen=True)
class Step:
    """One operation: its question sentence (without "Then"), its answer line, the new count."""

    sentence: str  # "She loses 9 stickers."
    line: str  # "She loses 9, so 43 - 9 = 34."
    count: int  # 34


Operation = Callable[[random.Random, Person, str, str, int], Step | None]  # (rng, person, friend, items, count)


# --- operations: each returns a Step, or None when it cannot apply to the current count ---------

def _amount_operation(sentence: str, action: str, sign: int) -> Operation:
    """An operation that adds (``sign`` = 1) or subtracts (-1) one amount; ``sentence`` and
    ``action`` are templates over subject, object, friend, amount and items."""
    def operation(rng: random.Random, person: Person, friend: str, items: str, count: int) -> Step | None:
        high = min(OPERAND_RANGE[1], MAX_COUNT - count if sign > 0 else count - 1)
        if high < OPERAND_RANGE[0]:
            return None
        amount = rng.randint(OPERAND_RANGE[0], high)
        words = {"subject": person.subject, "object": person.object, "friend": friend,
                 "amount": amount, "items": items}
        new = count + sign * amount
        symbol = "+" if sign > 0 else "-"
        line = f"{action.format(**words)}, so {count} {symbol} {amount} = {new}."
        return Step(sentence.format(**words), line, new)
    return operation


def _bags(rng: random.Random, person: Person, friend: str, items: str, count: int) -> Step | None:
    bags = rng.randint(*BAG_COUNT_RANGE)
    size = rng.randint(*BAG_SIZE_RANGE)
    product = bags * size
    if count + product > MAX_COUNT:
        return None
    new = count + product
    sentence = f"{person.subject} buys {bags} bags with {size} {items} in each bag."
    line = f"{person.subject} buys {bags} bags of {size}, so {bags} * {size} = {product} and {count} + {product} = {new}."
    return Step(sentence, line, new)


def _multiply(rng: random.Random, person: Person, friend: str, items: str, count: int) -> Step | None:
    factor = rng.choice((2, 3))
    if count > MAX_MULTIPLICAND or count * factor > MAX_COUNT:
        return None
    verb = "doubles" if factor == 2 else "triples"
    new = count * factor
    sentence = f"{person.subject} {verb} {person.possessive} {items}."
    return Step(sentence, f"{person.subject} {verb} them, so {count} * {factor} = {new}.", new)


OPERATIONS: tuple[Operation, ...] = (
    _amount_operation("{subject} buys {amount} more {items}.", "{subject} buys {amount} more", +1),
    _amount_operation("{subject} finds {amount} {items}.", "{subject} finds {amount}", +1),
    _amount_operation("{friend} gives {object} {amount} {items}.", "{friend} gives {object} {amount}", +1),
    _amount_operation("{subject} gives {amount} {items} to {friend}.", "{subject} gives {amount} to {friend}", -1),
    _amount_operation("{subject} sells {amount} {items}.", "{subject} sells {amount}", -1),
    _amount_operation("{subject} loses {amount} {items}.", "{subject} loses {amount}", -1),
    _bags,  # at most once per problem: its answer line is twice as long as the others
    _multiply,
)


def _person(rng: random.Random) -> Person:
    if rng.random() < 0.5:
        return Person(rng.choice(FEMALE_NAMES), "She", "her", "her")
    return Person(rng.choice(MALE_NAMES), "He", "him", "his")


def _then(sentence: str, person: Person) -> str:
    """'She buys ...' -> 'Then she buys ...'; a sentence led by a name keeps its capital."""
    if sentence.startswith(person.subject + " "):
        sentence = person.subject.lower() + sentence[len(person.subject):]
    return f"Then {sentence}"


def make_problem(rng: random.Random) -> dict[str, str]:
    """Draw one problem from ``rng`` (a ``random.Random``); see the module docstring for the shape."""
    person = _person(rng)
    friend = rng.choice([name for name in FEMALE_NAMES + MALE_NAMES if name != person.name])
    items = rng.choice(ITEMS)
    count = rng.randint(*START_RANGE)
    sentences = [f"{person.name} has {count} {items}."]
    lines = [f"{person.name} starts with {count} {items}."]
    operations = OPERATIONS
    for index in range(rng.randint(*STEPS_RANGE)):
        step = None
        while step is None:  # adding applies below 98 and subtracting above 2: some operation always fits
            operation = rng.choice(operations)
            step = operation(rng, person, friend, items, count)
        if operation is _bags:
            operations = tuple(other for other in OPERATIONS if other is not _bags)
        sentences.append(step.sentence if index == 0 else _then(step.sentence, person))
        lines.append(step.line)
        count = step.count
    sentences.append(f"How many {items} does {person.name} have now?")
    lines.append(f"{person.name} has {count} {items} now.")
    lines.append(f"#### {count}")
    return {"question": " ".join(sentences), "answer": "\n".join(lines), "target": str(count)}


def generate_problems(n: int, seed: int, exclude: Iterable[str] = ()) -> list[dict[str, str]]:
    """``n`` problems with distinct questions, none of them in ``exclude``; deterministic in ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen = set(exclude)
    problems: list[dict[str, str]] = []
    while len(problems) < n:
        problem = make_problem(rng)
        if problem["question"] in seen:
            continue
        seen.add(problem["question"])
        problems.append(problem)
    return problems


def generate_splits(n_train: int, n_test: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, test): the test set is drawn from ``seed + TEST_SEED_OFFSET``, the train set from
    ``seed`` with every test question excluded, so the two never share a question."""
    test = generate_problems(n_test, seed + TEST_SEED_OFFSET)
    train = generate_problems(n_train, seed, exclude=(problem["question"] for problem in test))
    return train, test


# --- answer checking --------------------------------------------------------------------------

def _normalize(number: str) -> str:
    """'1,234' -> '1234', '72.' -> '72', '72.50' -> '72.5', '72.00' -> '72'."""
    number = number.replace(",", "").rstrip(".")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return "0" if number == "-0" else number


def extract_answer(text: str) -> str | None:
    """The first number after the last ``####``; failing that, the last number in ``text``; else None."""
    marker = text.rfind("####")
    if marker != -1:
        match = _NUMBER.search(text, marker + 4)
        if match:
            return _normalize(match.group())
    numbers = _NUMBER.findall(text)
    return _normalize(numbers[-1]) if numbers else None


def is_correct(text: str, target: str) -> bool:
    """True when the answer extracted from ``text`` equals ``target`` (both normalized)."""
    answer = extract_answer(text)
    return answer is not None and answer == _normalize(target.strip())


# --- files ------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: Iterable[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({key: row[key] for key in ("question", "answer", "target")},
                                    ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_splits(out_dir: str | Path, n_train: int, n_test: int, seed: int,
                 train_path: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``<out_dir>/test.jsonl`` and the train set (``train_path``, default
    ``<out_dir>/train.jsonl``); return (train_path, test_path)."""
    train, test = generate_splits(n_train, n_test, seed)
    test_file = Path(out_dir) / "test.jsonl"
    train_file = Path(train_path) if train_path is not None else Path(out_dir) / "train.jsonl"
    write_jsonl(test_file, test)
    write_jsonl(train_file, train)
    return train_file, test_file
