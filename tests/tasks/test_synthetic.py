"""The synthetic GSM8K-format task: determinism, split hygiene, correct arithmetic, answer extraction."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refusion_cli.tasks.synthetic import (
    extract_answer,
    generate_problems,
    generate_splits,
    is_correct,
    read_jsonl,
    write_splits,
)

COMMITTED_TEST = Path(__file__).resolve().parents[2] / "evals" / "synthetic" / "test.jsonl"
EXPRESSION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


@pytest.fixture(scope="module")
def problems() -> list[dict[str, str]]:
    """The committed held-out set plus a fresh sample from another seed."""
    return read_jsonl(COMMITTED_TEST) + generate_problems(2000, seed=11)


def evaluate(left: int, operator: str, right: int) -> int:
    return {"+": left + right, "-": left - right, "*": left * right}[operator]


def replay_answer(answer: str) -> int:
    """Check every line of an answer and return the count its last line states.

    First line: "<name> starts with N <items>."; each step line: expressions "a op b = c" that
    are all right, the last of which continues from the previous count; then "<name> has N <items>
    now."; then "#### N"."""
    lines = answer.split("\n")
    count = int(re.fullmatch(r"[A-Z][a-z]+ starts with (\d+) [a-z]+\.", lines[0]).group(1))
    for line in lines[1:-2]:
        expressions = [match.groups() for match in EXPRESSION.finditer(line)]
        assert expressions, f"step line without arithmetic: {line!r}"
        for left, operator, right, result in expressions:
            assert evaluate(int(left), operator, int(right)) == int(result), line
        left, _, _, result = expressions[-1]
        assert int(left) == count, f"step does not continue from {count}: {line!r}"
        count = int(result)
    stated = int(re.fullmatch(r"[A-Z][a-z]+ has (\d+) [a-z]+ now\.", lines[-2]).group(1))
    assert stated == count
    assert lines[-1] == f"#### {count}"
    return count


def solve_question(question: str) -> int:
    """An independent reading of the question's sentences (the answer text is not used)."""
    sentences = re.split(r"(?<=[.?]) ", question)
    count = int(re.fullmatch(r"[A-Z][a-z]+ has (\d+) [a-z]+\.", sentences[0]).group(1))
    for sentence in sentences[1:-1]:
        sentence = sentence.removeprefix("Then ")
        if match := re.search(r"buys (\d+) bags with (\d+)", sentence):
            count += int(match.group(1)) * int(match.group(2))
        elif match := re.search(r"(?:buys|finds|gives (?:her|him)) (\d+)", sentence):
            count += int(match.group(1))
        elif match := re.search(r"(?:gives|sells|loses) (\d+)", sentence):
            count -= int(match.group(1))
        elif "doubles" in sentence:
            count *= 2
        elif "triples" in sentence:
            count *= 3
        else:
            raise AssertionError(f"unknown operation: {sentence!r}")
    assert re.fullmatch(r"How many [a-z]+ does [A-Z][a-z]+ have now\?", sentences[-1])
    return count


def test_same_seed_gives_same_problems() -> None:
    first = generate_problems(300, seed=5)
    assert first == generate_problems(300, seed=5)
    assert first[:100] == generate_problems(100, seed=5)  # a longer list extends a shorter one
    assert first != generate_problems(300, seed=6)


def test_problems_have_the_documented_fields() -> None:
    for problem in generate_problems(50, seed=2):
        assert set(problem) == {"question", "answer", "target"}
        assert problem["answer"].endswith(f"#### {problem['target']}")


def test_questions_within_a_list_are_distinct() -> None:
    questions = [problem["question"] for problem in generate_problems(3000, seed=3)]
    assert len(set(questions)) == len(questions)


def test_excluded_questions_never_come_back() -> None:
    first = generate_problems(20, seed=4)
    excluded = {problem["question"] for problem in first}
    again = generate_problems(20, seed=4, exclude=excluded)  # the same stream: every draw collides first
    assert not excluded & {problem["question"] for problem in again}


def test_train_and_test_share_no_question(tmp_path: Path) -> None:
    train_file, test_file = write_splits(tmp_path, n_train=3000, n_test=500, seed=0)
    train, test = read_jsonl(train_file), read_jsonl(test_file)
    assert (len(train), len(test)) == (3000, 500)
    assert not {row["question"] for row in train} & {row["question"] for row in test}


def test_test_split_does_not_depend_on_train_size() -> None:
    assert generate_splits(10, 100, seed=0)[1] == generate_splits(500, 100, seed=0)[1]


def test_committed_test_set_is_what_the_documented_command_writes() -> None:
    _, test = generate_splits(0, 500, seed=0)
    assert read_jsonl(COMMITTED_TEST) == test


def test_every_answer_is_correct_step_by_step(problems: list[dict[str, str]]) -> None:
    for problem in problems:
        assert replay_answer(problem["answer"]) == int(problem["target"])


def test_every_target_follows_from_the_question(problems: list[dict[str, str]]) -> None:
    for problem in problems:
        assert solve_question(problem["question"]) == int(problem["target"])


def test_problems_take_three_to_five_small_operations(problems: list[dict[str, str]]) -> None:
    for problem in problems:
        lines = problem["answer"].split("\n")
        assert 3 <= len(lines) - 3 <= 5
        for line in lines[1:-2]:
            earlier_results = set()
            for left, operator, right, result in EXPRESSION.findall(line):
                assert int(right) < 20 or right in earlier_results  # "4 * 9 = 36 and 37 + 36 = 73"
                assert 1 <= int(result) <= 99
                if operator == "*":
                    assert int(left) < 20
                earlier_results.add(result)


@pytest.mark.parametrize(("text", "expected"), [
    # real GSM8K answer format, with calculator annotations
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
     "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72", "72"),
    ("He spends 3 * 400 = $<<3*400=1200>>1200 a week.\nSo in total he spends 1,234 dollars.\n#### 1,234", "1234"),
    ("#### 3\nOn second thought 9 is wrong.\n#### 12", "12"),  # the last #### wins
    ("The loss is #### -5", "-5"),
    ("#### 2.50", "2.5"),
    ("#### 18.", "18"),
    ("#### $1,000", "1000"),
    ("She has 17 left, so the answer is ####", "17"),  # nothing after ####: last number
    ("Mia has 12 apples, then 19, then 14 apples.", "14"),  # no ####: last number
    ("The answer is 1,024.", "1024"),
    ("no number here", None),
    ("", None),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_is_correct() -> None:
    assert is_correct("Mia starts with 12 apples.\n12 + 7 = 19.\n19 - 5 = 14.\n#### 14", "14")
    assert is_correct("#### 1,234", "1234")
    assert is_correct("so she has 14 apples.", " 14 ")
    assert not is_correct("#### 15", "14")
    assert not is_correct("#### 140", "14")
    assert not is_correct("no answer", "14")
