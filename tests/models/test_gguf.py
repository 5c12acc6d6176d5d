"""`--model file.gguf`: a tiny random Llama written as a GGUF file here (llama.cpp's tensor names and q/k
layout, a byte-level BPE vocabulary and a chat template) loads with the same logits, tokens, template and stop
ids; the AR decoder runs it through `refusion eval`; a mask decoder, a missing gguf package, a missing or
damaged file is one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from refusion_cli.errors import UserError
from refusion_cli.models.loading import ASSETS, check_model_fits, load_model
from tests.harness.helpers import run_cli

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS, LAYERS = 4, 2, 2


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in the order llama.cpp's converter stores them (its rotary pairs halves differently)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(path: Path, model: torch.nn.Module, tokenizer_dir: Path) -> None:
    """``model`` (a LlamaForCausalLM) and the byte-level BPE tokenizer in ``tokenizer_dir`` as one GGUF file."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    special = {token["content"]: token["id"] for token in spec["added_tokens"]}
    tokens = sorted({**spec["model"]["vocab"], **special}.items(), key=lambda item: item[1])
    assert [index for _, index in tokens] == list(range(len(tokens)))
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in tokens])
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
                            for token, _ in tokens])
    writer.add_token_merges([" ".join(merge) for merge in spec["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8"))
    weights = {name: value.numpy() for name, value in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for ours, theirs in [("attn_norm", "input_layernorm"), ("attn_v", "self_attn.v_proj"),
                             ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            writer.add_tensor(f"blk.{layer}.{ours}.weight", weights[f"{prefix}{theirs}.weight"])
        writer.add_tensor(f"blk.{layer}.attn_q.weight",
                          permute_for_llama_cpp(weights[f"{prefix}self_attn.q_proj.weight"], HEADS))
        writer.add_tensor(f"blk.{layer}.attn_k.weight",
                          permute_for_llama_cpp(weights[f"{prefix}self_attn.k_proj.weight"], KV_HEADS))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_llama(seed: int) -> torch.nn.Module:
    """A random tiny Llama with the ar-tiny tokenizer's special ids."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    ids = AutoTokenizer.from_pretrained(str(ASSETS / "ar-tiny")).convert_tokens_to_ids
    config = LlamaConfig(vocab_size=460, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=ids("<|im_start|>"), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>"))
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A random Llama (seed 0) with the ar-tiny tokenizer (whose <|mask|> entry is not a mask here: renamed)."""
    folder = tmp_path_factory.mktemp("gguf")
    tokenizer_dir = folder / "tokenizer"
    tokenizer_dir.mkdir()
    text = (ASSETS / "ar-tiny" / "tokenizer.json").read_text(encoding="utf-8").replace("<|mask|>", "<|unused|>")
    (tokenizer_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    (tokenizer_dir / "chat_template.jinja").write_bytes((ASSETS / "ar-tiny" / "chat_template.jinja").read_bytes())
    model = random_llama(seed=0)
    path = folder / "Tiny-Llama.Q-none.gguf"
    write_gguf(path, model, tokenizer_dir)
    return path, model


def test_a_gguf_file_loads_with_the_same_logits_tokens_template_and_stop_ids(tiny_gguf):
    from transformers import AutoTokenizer

    path, source = tiny_gguf
    loaded = load_model(str(path), "cpu", torch.float32, require_mask=False)
    reference = AutoTokenizer.from_pretrained(str(ASSETS / "ar-tiny"))
    text = "Tom has 3 apples, buys 4 more: how many?"
    ids = loaded.tokenizer.encode(text)
    assert ids == reference.encode(text) and loaded.tokenizer.decode(ids) == text
    batch = torch.tensor([ids])
    assert torch.equal(loaded.model(batch).logits, source(batch).logits)
    im_end, endoftext = reference.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (loaded.family, loaded.mask_token_id, loaded.bidirectional) == ("llama", None, False)
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.stop_token_ids) == (im_end, endoftext, (im_end,))
    assert loaded.source == str(path.resolve())
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                  tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_refusion_eval_runs_the_ar_decoder_on_a_gguf_file(tiny_gguf, capsys, monkeypatch, tmp_path):
    path, _ = tiny_gguf
    run_dir = tmp_path / "run"
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "synthetic", "--decoder", "ar", "--model", str(path),
                                   "--limit", "2", "--set", "gen_length=8", "--device", "cpu", "--output", str(run_dir))
    assert code == 0, stderr
    [cell] = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert cell["decoder"] == "ar" and cell["samples"] == 2


def test_a_replaced_gguf_file_is_decoded_again_not_read_back_from_the_journal(tiny_gguf, capsys, monkeypatch,
                                                                             tmp_path):
    """The journal key is the file's content (its header's sha256, size and mtime), not its path as typed: another
    model written over the file, even of the same size and with the old mtime put back, decodes again."""
    from refusion_cli.models.checkpoint import resolve_checkpoint

    path = Path(shutil.copy(tiny_gguf[0], tmp_path / "model.gguf"))
    arguments = ["--task", "synthetic", "--decoder", "ar", "--model", str(path), "--limit", "1", "--set",
                 "gen_length=8", "--device", "cpu", "--output", str(tmp_path / "run")]

    def resumed() -> int:
        code, _, stderr = run_cli(capsys, monkeypatch, *arguments)
        assert code == 0, stderr
        [cell] = json.loads((tmp_path / "run" / "metrics.json").read_text())["results"]
        return cell["resumed"]

    assert resumed() == 0
    assert resumed() == 1  # the same file: its sample is read back
    before, stat = resolve_checkpoint(str(path)).fingerprint, path.stat()
    write_gguf(path, random_llama(seed=1), tiny_gguf[0].parent / "tokenizer")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and resolve_checkpoint(str(path)).fingerprint != before
    assert resumed() == 0  # another model under the same name: decoded again


def test_a_decoder_that_needs_a_mask_is_refused_in_one_line(tiny_gguf, capsys, monkeypatch, tmp_path):
    path, _ = tiny_gguf
    message = (f"error: '{path}' is a GGUF file, which holds a plain causal model without a mask token; the refusion "
               "decoder needs one (hint: run it with the AR decoder (--decoder ar))")
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "synthetic", "--decoder", "refusion", "--model",
                                   str(path), "--limit", "1", "--output", str(tmp_path / "run"))
    assert code == 2 and stderr.strip() == message
    with pytest.raises(UserError, match="a diffusion decoder needs one"):
        load_model(str(path), "cpu", require_mask=True)
    check_model_fits("ar", str(path))  # the AR decoder fits


def test_without_the_gguf_package_the_error_says_to_install_it(tiny_gguf, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "gguf" else
                        find_spec(name, *rest))
    with pytest.raises(UserError, match="needs the gguf package, which is not installed") as error:
        load_model(str(tiny_gguf[0]), "cpu", require_mask=False)
    assert error.value.hint == "pip install gguf"


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "missing"])
def test_a_missing_or_damaged_gguf_file_is_one_line(damage, tiny_gguf, tmp_path):
    path = tmp_path / "model.gguf"
    whole = tiny_gguf[0].read_bytes()
    if damage == "truncated":  # a download that stopped halfway
        path.write_bytes(whole[:len(whole) // 2])
    elif damage == "not_gguf":
        path.write_bytes(b"<html>404 Not Found</html>" * 100)
    with pytest.raises(UserError) as error:
        load_model(str(path), "cpu", require_mask=False)
    expected = f"no such GGUF file: '{path}'" if damage == "missing" else f"cannot read the GGUF file '{path}': "
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)
