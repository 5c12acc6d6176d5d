"""Checkpoints interchangeable with the public ReFusion reference, and its recipe as `--recipe reference`."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion_cli.models.loading import load_model
from refusion_cli.training.config import TrainConfig
from refusion_cli.training.loop import train_model
from refusion_cli.training.modeling import BEGIN_TOKEN, ensure_mask_token
from refusion_cli.training.recipes import RECIPES, apply_recipe
from tests.tiny import tiny_qwen3
from tests.training.training_helpers import (MASK, MICRO_CONFIG, arithmetic_records, error_line, make_tokenizer, run_cli,
                                             write_jsonl)
from tools.standins import qwen3_tokenizer

QWEN3_VOCAB = 151669  # Qwen3's tokenizer: 151643 BPE ranks, then 26 added tokens (<|endoftext|> ... </think>)
REFERENCE_BEGIN_ID, REFERENCE_MASK_ID = 151669, 151670  # where the reference's train.py puts its two tokens


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    """A Qwen3-layout checkpoint with random weights 8 wide and the 151669-token vocabulary, no mask token."""
    path = tmp_path_factory.mktemp("qwen3")
    tokenizer = qwen3_tokenizer(with_mask=False)  # Qwen3's as it ships, without a mask token
    assert len(tokenizer) == QWEN3_VOCAB and MASK not in tokenizer.get_vocab()
    config = Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_fine_tuning_qwen3_puts_the_mask_at_the_reference_id(qwen3_checkpoint, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arithmetic_records(4))
    result = train_model(TrainConfig(data=data, output=tmp_path / "run", model=str(qwen3_checkpoint), steps=1,
                                     batch_size=2, lr=1e-3, max_length=64, save_every=1))
    config = json.loads((result.final / "config.json").read_text())
    assert config["mask_token_id"] == REFERENCE_MASK_ID and config["vocab_size"] == REFERENCE_MASK_ID + 1
    loaded = load_model(str(result.final), device="cpu")  # the saved tokenizer, through AutoTokenizer
    tokenizer = loaded.tokenizer
    assert tokenizer.convert_tokens_to_ids([BEGIN_TOKEN, MASK]) == [REFERENCE_BEGIN_ID, REFERENCE_MASK_ID]
    assert len(tokenizer) == REFERENCE_MASK_ID + 1
    assert loaded.mask_token_id == REFERENCE_MASK_ID
    assert loaded.model.get_input_embeddings().weight.shape[0] == REFERENCE_MASK_ID + 1  # 151671 rows
    # the tokens went into the run's tokenizer only: the checkpoint's, as a process loads it again, has none
    base = load_model(str(qwen3_checkpoint), device="cpu", require_mask=False).tokenizer
    assert len(base) == QWEN3_VOCAB and MASK not in base.get_vocab()


def test_a_tokenizer_with_a_mask_keeps_its_id_and_gets_no_begin_token():
    tokenizer = make_tokenizer(with_mask=True)
    mask_id, size = tokenizer.convert_tokens_to_ids(MASK), len(tokenizer)
    model = tiny_qwen3(vocab=size)
    model.config.mask_token_id = None  # found through the tokenizer
    assert ensure_mask_token(model, tokenizer) == mask_id == model.config.mask_token_id
    assert len(tokenizer) == size and BEGIN_TOKEN not in tokenizer.get_vocab()
    assert model.get_input_embeddings().weight.shape[0] == size


def test_a_tokenizer_without_a_mask_gets_begin_then_mask_and_an_existing_begin_is_reused():
    tokenizer = make_tokenizer(with_mask=False)
    size = len(tokenizer)
    model = tiny_qwen3(vocab=size)
    model.config.mask_token_id = None
    assert ensure_mask_token(model, tokenizer) == size + 1
    assert tokenizer.convert_tokens_to_ids([BEGIN_TOKEN, MASK]) == [size, size + 1]
    assert BEGIN_TOKEN in tokenizer.all_special_tokens and MASK in tokenizer.all_special_tokens
    assert model.get_input_embeddings().weight.shape[0] == size + 2

    has_begin = make_tokenizer(with_mask=False)
    has_begin.add_special_tokens({"additional_special_tokens": [BEGIN_TOKEN]})
    model = tiny_qwen3(vocab=len(has_begin))
    model.config.mask_token_id = None
    assert ensure_mask_token(model, has_begin) == size + 1 and has_begin.convert_tokens_to_ids(BEGIN_TOKEN) == size


def test_the_reference_recipe_sets_exactly_its_values_and_explicit_options_win():
    assert RECIPES["reference"] == {"lr": 2e-5, "warmup_ratio": 0.0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                                    "mixed_precision": "bf16", "epochs": 4, "max_length": 4096,
                                    "gradient_checkpointing": True}
    defaults = {"data": Path("d.jsonl"), "output": Path("out"), "init": "tiny", "tokenizer": "tok",
                "lr": 1e-4, "warmup_ratio": 0.03, "max_length": 1024, "steps": 1000}
    config = TrainConfig(**apply_recipe("reference", defaults, explicit=set()))
    names = {f.name for f in fields(TrainConfig)}
    assert set(RECIPES["reference"]) <= names
    assert {key: getattr(config, key) for key in RECIPES["reference"]} == RECIPES["reference"]
    mine = TrainConfig(**apply_recipe("reference", defaults, explicit={"lr", "steps"}))
    assert mine.lr == 1e-4 and mine.steps == 1000 and mine.epochs is None and mine.max_length == 4096
    assert apply_recipe(None, defaults, explicit=set()) == defaults


@pytest.fixture
def recipe_run(tmp_path) -> list[str]:
    write_jsonl(tmp_path / "data.jsonl", arithmetic_records(6))
    make_tokenizer().save_pretrained(tmp_path / "tokenizer")
    return ["train", "--data", str(tmp_path / "data.jsonl"), "--output", str(tmp_path / "run"), "--init", "tiny",
            "--tokenizer", str(tmp_path / "tokenizer"), "--model-config", json.dumps(MICRO_CONFIG),
            "--batch-size", "4", "--save-every", "100", "--recipe", "reference"]


def test_recipe_trains_four_epochs_in_bf16_on_cpu_with_an_explicit_lr(recipe_run, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli([*recipe_run, "--lr", "1e-3"], capsys, monkeypatch)
    assert code == 0, err
    assert "precision bf16" in out and "done: 6 steps" in out  # ceil(4 epochs × 6 examples / 4)
    run = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["run"]
    assert (run["lr"], run["warmup_ratio"], run["max_length"], run["epochs"], run["steps"]) == (1e-3, 0.0, 4096, 4, 6)


def test_explicit_steps_replace_the_recipe_epochs(recipe_run, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli([*recipe_run, "--steps", "1", "--mixed-precision", "no"], capsys, monkeypatch)
    assert code == 0, err
    assert "precision no" in out and "done: 1 step," in out
    run = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["run"]
    assert "epochs" not in run and run["steps"] == 1 and run["lr"] == 2e-5


@pytest.mark.parametrize(("extra", "message"), [
    (["--recipe", "nope"], "error: unknown --recipe 'nope'; choose one of: reference"),
    (["--steps", "2", "--epochs", "1"], "error: give either --steps or --epochs, not both"),
    (["--epochs", "0"], "error: --epochs must be at least 1 (got 0)"),
])
def test_bad_recipe_or_run_length_is_one_error_line(recipe_run, extra, message, tmp_path, capsys, monkeypatch):
    args = [*recipe_run[:-2], *extra]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and error_line(err) == message
    assert not (tmp_path / "run").exists()
