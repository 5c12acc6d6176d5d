"""Reading JSONL, chat formatting, skipping long records, and the resumable data order."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from refusion_cli.errors import UserError
from refusion_cli.training.data import ObjectiveDataset, ShuffledStream, load_training_data, read_records
from refusion_cli.training.objectives import IGNORE_INDEX, OBJECTIVES, Example
from tests.training.training_helpers import arithmetic_records, make_tokenizer, write_jsonl


def test_records_are_formatted_with_the_chat_template(tmp_path):
    tokenizer = make_tokenizer()
    path = tmp_path / "data.jsonl"
    path.write_text('{"query": "what is two plus two ?", "response": "four ."}\n\n'
                    '{"prompt": "what is one ?", "completion": "one"}\n'
                    '{"question": "what is one ?", "answer": "one", "target": "1"}\n')
    data = load_training_data(path, tokenizer, max_length=64)
    assert data.records == 3 and data.skipped_too_long == 0 and data.examples[1] == data.examples[2]
    first = data.examples[0]
    template = "<|im_start|>user\nwhat is two plus two ?<|im_end|>\n<|im_start|>assistant\n"
    assert list(first.prompt_ids) == tokenizer(template, add_special_tokens=False)["input_ids"]
    assert list(first.response_ids) == tokenizer("four .", add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert data.examples[1].response_ids[-1] == tokenizer.eos_token_id


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "data.jsonl", [{"query": "what is one ?", "response": "one"}])
    with pytest.raises(UserError) as error:
        load_training_data(path, tokenizer, max_length=64)
    assert str(error.value) == "the tokenizer has no chat template; training formats every record as a chat turn"


def test_malformed_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"query": "a", "response": "b"}\n{"query": "a", "response": "b"}\n{"query": "a", resp\n')
    with pytest.raises(UserError, match=rf"{path}, line 3, is not valid JSON"):
        read_records(path)


def test_record_without_the_expected_fields_names_the_line(tmp_path):
    path = tmp_path / "fields.jsonl"
    path.write_text('{"query": "a", "response": "b"}\n{"instruction": "a", "output": "b"}\n')
    with pytest.raises(UserError, match=rf"{path}, line 2, has none of the record formats") as error:
        read_records(path)
    assert error.value.hint.startswith('each line is a JSON object with {"query", "response"} or')
    path.write_text('{"query": "a", "response": 3}\n')
    with pytest.raises(UserError, match=r", line 1: 'query' and 'response' must be strings"):
        read_records(path)
    path.write_text('{"query": "a", "response": "b"}\n["a", "b"]\n')
    with pytest.raises(UserError, match=rf"{path}, line 2, is not a JSON object"):
        read_records(path)


def test_empty_dataset_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(UserError, match="holds no records"):
        load_training_data(path, make_tokenizer(), max_length=64)
    with pytest.raises(UserError, match="no such data file"):
        read_records(tmp_path / "missing.jsonl")


def test_too_long_records_are_skipped_and_counted(tmp_path):
    records = arithmetic_records(3) + [{"query": "what is one ?", "response": " ".join(["one"] * 80)}]
    data = load_training_data(write_jsonl(tmp_path / "d.jsonl", records), make_tokenizer(), max_length=40)
    assert data.records == 4 and data.skipped_too_long == 1 and len(data.examples) == 3
    with pytest.raises(UserError, match="all 4 records .* are longer than --max-length 5"):
        load_training_data(tmp_path / "d.jsonl", make_tokenizer(), max_length=5)


def test_a_record_of_exactly_max_length_tokens_is_kept(tmp_path):
    """As in the reference train.py: a record is skipped only when prompt + response + EOS exceed max_length."""
    path = write_jsonl(tmp_path / "d.jsonl", arithmetic_records(1))
    (example,) = load_training_data(path, make_tokenizer(), max_length=10_000).examples
    length = len(example.prompt_ids) + len(example.response_ids)
    assert load_training_data(path, make_tokenizer(), max_length=length).examples == [example]
    with pytest.raises(UserError, match="longer than --max-length"):
        load_training_data(path, make_tokenizer(), max_length=length - 1)


def test_stream_is_a_fresh_permutation_per_epoch_and_resumes_at_any_position():
    stream = list(itertools.islice(ShuffledStream(7, seed=3), 21))
    epochs = [stream[i * 7:(i + 1) * 7] for i in range(3)]
    for epoch, part in enumerate(epochs):
        assert {e for e, _ in part} == {epoch} and sorted(i for _, i in part) == list(range(7))
    assert [i for _, i in epochs[0]] != [i for _, i in epochs[1]]
    for start in (0, 5, 7, 13):  # skipping `start` examples gives exactly the rest of the stream
        assert list(itertools.islice(ShuffledStream(7, seed=3, start=start), 21 - start)) == stream[start:]
    assert list(itertools.islice(ShuffledStream(7, seed=4), 7)) != stream[:7]


def test_samples_depend_on_seed_epoch_and_index_only():
    examples = [Example((1, 2), tuple(range(10, 40)) + (62,)) for _ in range(3)]
    dataset = ObjectiveDataset(examples, OBJECTIVES["refusion"], mask_id=63, seed=0)
    again = ObjectiveDataset(examples, OBJECTIVES["refusion"], mask_id=63, seed=0)
    assert torch.equal(dataset[(1, 2)].input_ids, again[(1, 2)].input_ids)  # same key, same sample
    draws = {tuple(dataset[(epoch, 0)].input_ids.tolist()) for epoch in range(8)}
    assert len(draws) > 1  # a new epoch redraws the masking of the same example


def test_llada_samples_pad_every_response_with_eos_to_one_length():
    eos, mask = 62, 63
    examples = [Example((1, 2), (10, 11, eos)), Example((1, 2, 3), (10, 11, 12, 13, 14, eos))]
    dataset = ObjectiveDataset(examples, OBJECTIVES["llada"], mask_id=mask, seed=0)
    short = dataset[(0, 0)]
    assert short.input_ids.numel() == 2 + 6  # the short response is padded to the longest (6 tokens)
    original = torch.where(short.labels == IGNORE_INDEX, short.input_ids, short.labels)
    assert original.tolist() == [1, 2, 10, 11, eos, eos, eos, eos]  # padded with EOS, labels included
    assert torch.equal(short.position_ids, torch.arange(8))
    weights = short.loss_weights[short.labels != IGNORE_INDEX].tolist()
    assert weights and weights == pytest.approx([1 / (short.mask_prob * 6)] * len(weights))  # ÷ padded length
    capped = ObjectiveDataset(examples, OBJECTIVES["llada"], mask_id=mask, seed=0, max_length=6)[(0, 0)]
    assert capped.input_ids.numel() == 6  # never past max_length
    for name in ("refusion", "ar"):  # the causal objectives are not padded
        assert ObjectiveDataset(examples, OBJECTIVES[name], mask_id=mask, seed=0)[(0, 0)].input_ids.numel() == 5


def test_a_data_path_that_is_not_a_regular_file_is_named_so():
    with pytest.raises(UserError, match="the data path /dev/null is not a regular file"):
        read_records(Path("/dev/null"))
