"""The text side of a response, without a server: incremental detokenization (linear in the answer, the same text
as decoding it whole), the stop rule the scheduler runs (it reads only the new tokens), and the streamed deltas
(appended only, joined the answer)."""

from __future__ import annotations

import pytest

from refusion_cli.decoding.rows import Commit
from refusion_cli.models.loading import load_model
from refusion_cli.serve.text import Detokenizer, PrefixText, StopWatch, TextRules, answer_text

TEXT = "Mia starts with 34 marbles.\nShe sells 2, so 34 - 2 = 32. Ünïcödé ✓ done.\n" * 6


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("refusion-tiny", "cpu").tokenizer


class CountingTokenizer:
    """A tokenizer that counts the tokens it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.decoded = 0

    def decode(self, ids, **options):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **options)


def test_incremental_text_is_the_whole_decode_at_linear_cost(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    counting = CountingTokenizer(tokenizer)
    detokenizer = Detokenizer(counting)
    pieces = [detokenizer.push(token) for token in ids]
    assert "".join(pieces) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 12 * len(ids)  # a short window a token, not the prefix


def test_the_stop_rule_ends_at_the_token_completing_a_stop_string(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    rules = TextRules(frozenset(tokenizer.all_special_ids), stops=("= 32",))
    watch = StopWatch(tokenizer, rules)
    kept = None
    for length in range(1, len(ids) + 1):  # the prefix grows a token a step
        kept = watch(ids[:length])
        if kept is not None:
            break
    text = tokenizer.decode(ids[:kept])
    assert "= 32" in text and watch.reason == "stop"
    assert "= 32" not in tokenizer.decode(ids[:kept - 1])  # not a token later than needed
    assert answer_text(tokenizer, ids[:kept], rules) == TEXT[: TEXT.find("= 32")]


def test_min_tokens_and_the_cap_of_the_stop_rule(tokenizer):
    end = tokenizer.all_special_ids[0]
    ids = tokenizer("one two three four five six", add_special_tokens=False)["input_ids"]
    response = ids[:2] + [end] + ids[2:] + [end] + ids
    rules = TextRules(frozenset([end]), min_tokens=4)
    assert StopWatch(tokenizer, rules)(response) == len(ids) + 2  # the first end id at offset 4 or later
    assert StopWatch(tokenizer, TextRules(frozenset([end]), ignore_eos=True, max_tokens=5))(response) == 5
    watch = StopWatch(tokenizer, TextRules(frozenset([end]), ignore_eos=True))
    assert watch(response) is None and watch.reason is None


def test_streamed_deltas_out_of_order_join_to_the_answer(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    rules = TextRules(frozenset(tokenizer.all_special_ids), stops=("sells 2, so 34 - 2 = 32. Ünï",))
    stream = PrefixText(tokenizer, rules)
    order = [offset for block in range(0, len(ids), 8) for offset in reversed(range(block, min(block + 8, len(ids))))]
    deltas = [stream.add([Commit(offset, ids[offset], "first")]) for offset in order]
    answer = answer_text(tokenizer, ids, rules)
    deltas.append(stream.finish(answer))
    assert "".join(deltas) == answer == TEXT[: TEXT.find("sells 2, so")]
