"""load_model on a checkpoint laid out like GSAI-ML/ReFusion, and the errors a user can hit."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion_cli.decoding import ReFusionConfig, run_decoder
from refusion_cli.errors import UserError
from refusion_cli.models import load_model
from refusion_cli.models.checkpoint import embedded_path
from refusion_cli.models.loading import stop_ids
from tools.standins import qwen3_tokenizer


@pytest.fixture(scope="module")
def refusion_layout(tmp_path_factory) -> Path:
    """A directory laid out like GSAI-ML/ReFusion: Qwen3 config with mask_token_id, Qwen tokenizer with <|mask|>."""
    path = tmp_path_factory.mktemp("refusion-layout")
    tokenizer = qwen3_tokenizer(with_mask=True)
    config = Qwen3Config(vocab_size=151671, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True, mask_token_id=151670, eos_token_id=151645, pad_token_id=151643,
                         initializer_range=0.5)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_refusion_layout_loads_with_the_right_special_ids(refusion_layout):
    loaded = load_model(str(refusion_layout), device="cpu", dtype=torch.float32)
    assert type(loaded.model).__name__ == "Qwen3ForCausalLM"  # the stock class, no remote code
    assert (loaded.mask_token_id, loaded.eos_token_id, loaded.pad_token_id) == (151670, 151645, 151643)
    assert loaded.family == "qwen3" and not loaded.bidirectional
    tok = loaded.tokenizer
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|mask|>"]) == [151644, 151645, 151670]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == 151644 and ids[-5:-2] == [151645, 198, 151644]  # <|im_end|> "\n" <|im_start|>
    assert tok.decode(ids) == text  # the BPE round-trips

    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.5, token_threshold=0.5)
    result = run_decoder("refusion", loaded.model, ids, config, mask_token_id=loaded.mask_token_id,
                         eos_token_id=loaded.eos_token_id)
    assert 1 <= len(result.tokens) <= 16
    assert loaded.mask_token_id not in result.tokens
    assert isinstance(tok.decode(result.tokens), str)


def test_a_response_ends_at_any_eos_id_of_the_generation_config(refusion_layout, tmp_path):
    """Qwen3 chat checkpoints list <|im_end|> and <|endoftext|> in generation_config.json, as generate stops."""
    assert load_model(str(refusion_layout), device="cpu").stop_token_ids == (151645,)  # config.json's one id
    path = tmp_path / "two-eos"
    path.mkdir()
    for item in refusion_layout.iterdir():
        (path / item.name).write_bytes(item.read_bytes())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643], "pad_token_id": 0}))
    loaded = load_model(str(path), device="cpu")
    assert loaded.eos_token_id == 151645  # the tokenizer's, still what training appends
    assert loaded.stop_token_ids == (151645, 151643)


@pytest.mark.parametrize("listed, message", [
    ([151645, None], "None is not a token id"),
    ([151645, True], "True is not a token id"),
    ("151643", "'151643' is not a token id"),
    (-1, "-1 is not a token id"),
])
def test_an_eos_that_is_no_token_id_is_one_error_naming_its_file(listed, message):
    """Every kind of broken eos_token_id is a UserError naming the file, not a traceback or a wrong stop (read
    from a checkpoint's files in the test below, with an id past the vocabulary)."""
    with pytest.raises(UserError, match=r"lists eos_token_id .* in its generation_config.json: ") as caught:
        stop_ids(151645, SimpleNamespace(eos_token_id=listed), SimpleNamespace(eos_token_id=151645),
                 vocab_size=151671, name="ckpt")
    assert message in str(caught.value)
    with pytest.raises(UserError, match=r"lists eos_token_id .* in its config.json: "):  # no generation config
        stop_ids(151645, None, SimpleNamespace(eos_token_id=listed), vocab_size=151671, name="ckpt")


def test_a_generation_config_eos_that_is_no_token_id_is_one_error(refusion_layout, tmp_path):
    """A broken eos_token_id in generation_config.json is a UserError at load time."""
    path = tmp_path / "bad-eos"
    path.mkdir()
    for item in refusion_layout.iterdir():
        (path / item.name).write_bytes(item.read_bytes())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 200000]}))
    with pytest.raises(UserError, match="lists eos_token_id .* in its generation_config.json: ") as caught:
        load_model(str(path), device="cpu")
    assert "200000 is not a token id (the vocabulary has 151671 ids)" in str(caught.value)


def test_no_such_directory(tmp_path):
    with pytest.raises(UserError, match="no such checkpoint directory"):
        load_model(str(tmp_path / "missing"))


def test_hub_id_with_the_hub_unreachable_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(UserError, match="hub is unreachable, and it is not in the local cache"):
        load_model("GSAI-ML/ReFusion")
    assert time.perf_counter() - start < 10


def test_a_checkpoint_without_a_mask_token_is_refused_for_diffusion_decoding(tmp_path, refusion_layout):
    config = json.loads((refusion_layout / "config.json").read_text())
    config.pop("mask_token_id")
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in os.listdir(refusion_layout):
        if name != "config.json":
            (plain / name).write_bytes((refusion_layout / name).read_bytes())
    (plain / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((plain / "tokenizer_config.json").read_text())
    tok_config.pop("mask_token", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tok_config))
    # the tokenizer still knows <|mask|>: drop it from the added tokens too
    tok_json = json.loads((plain / "tokenizer.json").read_text())
    tok_json["added_tokens"] = [t for t in tok_json["added_tokens"] if t["content"] != "<|mask|>"]
    (plain / "tokenizer.json").write_text(json.dumps(tok_json))
    extra = tok_config.get("extra_special_tokens") or tok_config.get("additional_special_tokens")
    if isinstance(extra, list) and "<|mask|>" in extra:
        extra.remove("<|mask|>")
        (plain / "tokenizer_config.json").write_text(json.dumps(tok_config))
    with pytest.raises(UserError, match="has no mask token"):
        load_model(str(plain), device="cpu")
    loaded = load_model(str(plain), device="cpu", require_mask=False)  # fine for AR decoding
    assert loaded.mask_token_id is None


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 8}))
    with pytest.raises(UserError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_remote_code_checkpoints_need_explicit_trust(tmp_path):
    """A model type transformers does not know, with its own code behind an auto_map (LLaDA and Dream load natively)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mystery", "architectures": ["MysteryLM"],
        "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig", "AutoModel": "modeling_mystery.MysteryLM"},
    }))
    with pytest.raises(UserError, match="needs its authors' modelling code") as info:
        load_model(str(tmp_path))
    assert "--trust-remote-code" in info.value.hint


def test_a_directory_without_config_is_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="holds no config.json"):
        load_model(str(tmp_path))


def test_a_local_folder_named_like_an_embedded_model_wins(tmp_path, monkeypatch):
    """As with from_pretrained, a directory in the working directory comes before the shipped name."""
    from refusion_cli.decoding.spec import parse_decoder_options
    from refusion_cli.harness.runner import decoder_runs as runs_of

    def decoder_runs(decoders, models):
        return runs_of(parse_decoder_options(decoders, models))
    from refusion_cli.models.checkpoint import Kind, embedded_path, is_embedded, locate

    shipped = locate("refusion-tiny")
    assert (shipped.kind, shipped.source) == (Kind.EMBEDDED, str(embedded_path("refusion-tiny")))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "refusion-tiny").mkdir()
    assert not is_embedded("refusion-tiny")
    with pytest.raises(UserError, match="'refusion-tiny' is a local path but holds no config.json"):
        load_model("refusion-tiny")
    (tmp_path / "refusion-tiny" / "config.json").write_text("{}")
    local = locate("refusion-tiny")
    assert (local.kind, local.source, local.local_only) == (Kind.FOLDER, "refusion-tiny", True)
    assert decoder_runs(["refusion"], ["refusion-tiny"])[0].label == "refusion:./refusion-tiny"
    assert is_embedded("ar-tiny") and decoder_runs(["ar"], [])[0].label == "ar:ar-tiny"


def test_a_checkpoint_trained_for_shifted_logits_fits_dream_not_llada(bidirectional_checkpoint, tmp_path):
    import shutil

    from refusion_cli.models.loading import check_model_fits, inspect_checkpoint

    assert inspect_checkpoint(str(bidirectional_checkpoint)).shifted is None  # not recorded: either decoder runs
    for decoder in ("llada", "dream"):
        check_model_fits(decoder, str(bidirectional_checkpoint))
    for shifted, fits, refused in ((True, "dream", "llada"), (False, "llada", "dream")):
        copy = Path(shutil.copytree(bidirectional_checkpoint, tmp_path / f"shifted-{shifted}"))
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "shifted_logits": shifted}))
        assert load_model(str(copy), "cpu").shifted is shifted
        check_model_fits(fits, str(copy))
        with pytest.raises(UserError, match=f"the {refused} decoder does not fit this model"):
            check_model_fits(refused, str(copy))


def test_the_same_files_give_the_same_tokenizer_and_an_edited_file_a_new_one(tmp_path):
    """A process reads a checkpoint's tokenizer once (eval, bench and serve load a checkpoint per decoder), and
    again once one of its files changed."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(embedded_path("refusion-tiny"), folder)
    first = load_model(str(folder), device="cpu").tokenizer
    assert load_model(str(folder), device="cpu").tokenizer is first
    (folder / "chat_template.jinja").write_text("{% for message in messages %}[{{ message['content'] }}]{% endfor %}")
    edited = load_model(str(folder), device="cpu").tokenizer
    assert edited is not first
    assert edited.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
