"""Training data: JSONL records -> tokenized examples -> a deterministic, resumable stream of samples.

A record is ``{"query": ..., "response": ...}`` (the reference format), ``{"prompt": ...,
"completion": ...}``, or GSM8K's ``{"question": ..., "answer": ...}`` (the layout of
``refusion_cli.tasks.synthetic``); other fields are ignored. It is formatted with the tokenizer's
chat template: the prompt ids are the user turn plus the assistant header
(``add_generation_prompt=True``); the response ids are the response text's tokens followed by the
tokenizer's EOS (``<|im_end|>`` for Qwen3 chat models).

The order of the data is a fresh permutation per epoch, drawn from the seed; the stream position is
counted in examples, so a resumed run skips exactly the examples already consumed, whatever the
number of processes. The random choices of an objective for an example are drawn from a generator
seeded by (seed, epoch, example index): the same sample on every process and after a resume. A
held-out (eval) example gets its own generator, seeded by (seed, "eval", example index): the same
sample at every evaluation, drawn apart from the training streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from refusion_cli.errors import UserError
from refusion_cli.jsonl import json_objects, read_text
from refusion_cli.models.chat import require_chat_template
from refusion_cli.training.objectives import Example, Objective, Sample, pad_with_eos

RECORD_FORMATS = (("query", "response"), ("prompt", "completion"), ("question", "answer"))
FORMATS_HINT = "each line is a JSON object with " + " or ".join('{"%s", "%s"}' % pair for pair in RECORD_FORMATS)


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line number in the file
    prompt: str
    response: str


@dataclass(frozen=True)
class TrainingData:
    examples: list[Example]
    records: int  # records read from the file
    skipped_too_long: int  # records longer than max_length, left out

    @property
    def tokens(self) -> int:
        return sum(len(e.prompt_ids) + len(e.response_ids) for e in self.examples)


def data_noun(option: str) -> str:
    """What the messages call the file an option names: '--data' -> 'data', '--eval-data' -> 'eval data'."""
    return option.lstrip("-").replace("-", " ")


def check_data_file(path: Path, option: str = "--data") -> None:
    """The data path (given with ``option``) names an existing file (not a directory)."""
    noun = data_noun(option)
    if Path(path).is_dir():
        raise UserError(f"the {noun} path {path} is a directory, not a JSONL file",
                        hint=f"give {option} the JSONL file itself")
    if Path(path).exists() and not Path(path).is_file():
        raise UserError(f"the {noun} path {path} is not a regular file", hint=f"give {option} a JSONL file")
    if not Path(path).is_file():
        raise UserError(f"no such {noun} file: {path}")


def read_records(path: Path, option: str = "--data") -> list[Record]:
    """Parse a JSONL file; blank lines are skipped, anything else malformed names the file and line."""
    check_data_file(path, option)
    text = read_text(path, f"the {data_noun(option)} file {path}")
    return [_record(value, path, number) for number, value in json_objects(text, str(path), FORMATS_HINT)]


def _record(value: dict, path: Path, number: int) -> Record:
    for prompt_key, response_key in RECORD_FORMATS:
        if prompt_key in value and response_key in value:
            prompt, response = value[prompt_key], value[response_key]
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise UserError(f"{path}, line {number}: '{prompt_key}' and '{response_key}' must be strings")
            return Record(number, prompt, response)
    raise UserError(f"{path}, line {number}, has none of the record formats", hint=FORMATS_HINT)


def chat_prompt_text(tokenizer, prompt: str) -> str:
    """The user turn and the assistant header, as the chat template renders them."""
    require_chat_template(tokenizer, use="training formats every record as a chat turn")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


def tokenize_records(tokenizer, records: list[Record], eos_id: int, chunk: int = 1024) -> list[Example]:
    """Prompt ids (chat template) and response ids + EOS for each record, tokenized in chunks."""
    examples = []
    for begin in range(0, len(records), chunk):
        part = records[begin:begin + chunk]
        prompts = tokenizer([chat_prompt_text(tokenizer, r.prompt) for r in part], add_special_tokens=False)
        responses = tokenizer([r.response for r in part], add_special_tokens=False)
        for prompt_ids, response_ids in zip(prompts["input_ids"], responses["input_ids"], strict=True):
            examples.append(Example(tuple(prompt_ids), (*response_ids, eos_id)))
    return examples


def load_training_data(path: Path, tokenizer, max_length: int, option: str = "--data") -> TrainingData:
    """Read and tokenize every record; records longer than ``max_length`` tokens are skipped and counted.

    ``option`` names the file in the messages: ``--data``, or ``--eval-data`` for the held-out set.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UserError("the tokenizer defines no EOS token to end each response with")
    records = read_records(path, option)
    if not records:
        raise UserError(f"the {data_noun(option)} file {path} holds no records")
    examples, skipped = [], 0
    for example in tokenize_records(tokenizer, records, int(eos_id)):
        if len(example.prompt_ids) + len(example.response_ids) > max_length:
            skipped += 1
        else:
            examples.append(example)
    if not examples:
        raise UserError(f"all {len(records)} records of {path} are longer than --max-length {max_length} tokens",
                        hint="raise --max-length or shorten the records")
    return TrainingData(examples, len(records), skipped)


def file_digest(path: Path) -> str:
    """sha256 of the data file: a resumed run checks it reads the same data."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def derived_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part (and nothing else)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class ShuffledStream(Sampler[tuple[int, int]]):
    """An endless stream of (epoch, example index): every epoch is a permutation drawn from the seed.

    ``start`` skips that many examples of the stream (the examples a resumed run already consumed).
    """

    def __init__(self, size: int, seed: int, start: int = 0):
        if size <= 0:
            raise ValueError("an empty dataset has no order")
        self.size, self.seed, self.start = size, seed, start

    def epoch_order(self, epoch: int) -> list[int]:
        order_rng = torch.Generator().manual_seed(derived_seed(self.seed, "order", epoch))
        return torch.randperm(self.size, generator=order_rng).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, offset = divmod(self.start, self.size)
        while True:
            for index in self.epoch_order(epoch)[offset:]:
                yield epoch, index
            epoch, offset = epoch + 1, 0


class ExampleSamples(Dataset):
    """The objective's samples of ``examples``, each drawn with a generator of a given seed (the subclasses
    say which key a sample has, and which seed it draws with).

    For an objective with ``eos_padding`` (LLaDA) every response is first padded with EOS to
    ``response_length`` (default: the longest response of the data set), capped so that no row
    exceeds ``max_length`` tokens: one fixed length, so a sample does not depend on which batch or
    process it lands in. A longer response is left as it is.
    """

    def __init__(self, examples: list[Example], objective: Objective, mask_id: int, seed: int,
                 max_length: int | None = None, response_length: int | None = None):
        self.examples, self.objective, self.mask_id, self.seed = examples, objective, mask_id, seed
        self.max_length = max_length
        if response_length is None:
            response_length = max((len(e.response_ids) for e in examples), default=0)
        self.response_length = response_length

    def __len__(self) -> int:
        return len(self.examples)

    def sample(self, index: int, seed: int) -> Sample:
        """The sample of example ``index``, its random choices drawn from a generator seeded with ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        example = self.examples[index]
        if self.objective.eos_padding:
            length = self.response_length
            if self.max_length is not None:
                length = min(length, self.max_length - len(example.prompt_ids))
            example = pad_with_eos(example, length)
        return self.objective.build(example, self.mask_id, generator)


class ObjectiveDataset(ExampleSamples):
    """Builds the objective's sample for a (epoch, index) key, with a generator seeded from the key."""

    def __getitem__(self, key: tuple[int, int]) -> Sample:
        epoch, index = key
        return self.sample(index, derived_seed(self.seed, "sample", epoch, index))


class HeldOutDataset(ExampleSamples):
    """The eval set: example ``index`` always gets the sample of the generator seeded by (seed, "eval", index).

    The draws do not depend on the training step, the epoch, the batch or the process, and they take
    nothing from the training streams: an unchanged model scores the same samples at every evaluation.
    For LLaDA pass the training set's ``response_length``: eval responses are padded to the canvas
    the model is trained on.
    """

    def __getitem__(self, index: int) -> Sample:
        return self.sample(index, derived_seed(self.seed, "eval", index))
