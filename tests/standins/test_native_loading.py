"""The public checkpoints' layouts load with transformers' own classes, and decode batched as alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from refusion_cli.decoding import DreamConfig, LLaDAConfig, run_decoder
from refusion_cli.decoding.mdm import attends_causally
from refusion_cli.errors import UserError
from refusion_cli.models import load_model
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import check_model_fits, inspect_checkpoint, resolve_checkpoint

# what each stand-in must load as: class, mask id, EOS, stop ids, bidirectional, shifted
EXPECTED = {
    "refusion": ("Qwen3ForCausalLM", 151670, 151645, (151645, 151643), False, None),
    "qwen3-8b": ("Qwen3ForCausalLM", None, 151645, (151645, 151643), False, None),
    "llada-8b-instruct": ("LlamaForCausalLM", 126336, 126081, (126081,), True, False),
    "dream-v0-instruct-7b": ("Qwen2ForCausalLM", 151666, 151643, (151643,), True, True),
    "llama-3-8b-instruct": ("LlamaForCausalLM", None, 128009, (128009, 128001), False, None),  # <|eot_id|>, then
}                                                                                          # <|end_of_text|>
QUESTIONS = ("What is 12 + 7?", "Mia has 12 apples. She buys 7 more and gives 5 to Max. How many are left?")


# `make test-all`: Qwen3-8B, whose stand-in no other default test builds; its class, EOS and stop ids are
# ReFusion's (checked by default), and a Qwen3 checkpoint without a mask token is loaded in
# tests/training/test_reference_compat.py
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "qwen3-8b" else name
                                  for name in sorted(EXPECTED)])
def test_each_checkpoint_loads_with_stock_classes_and_its_ids(standin, name):
    model_class, mask_id, eos_id, stops, bidirectional, shifted = EXPECTED[name]
    loaded = load_model(str(standin(name)), "cpu", torch.float32, require_mask=mask_id is not None)
    assert type(loaded.model).__name__ == model_class
    assert type(loaded.model).__module__.startswith("transformers.models.")  # never the checkpoint's own code
    assert (loaded.mask_token_id, loaded.eos_token_id, loaded.stop_token_ids) == (mask_id, eos_id, stops)
    assert (loaded.bidirectional, loaded.shifted) == (bidirectional, shifted)
    assert attends_causally(loaded.model) is not bidirectional
    # --trust-remote-code changes nothing for these: the record the load follows (classes, config, layout) is equal
    trusted = resolve_checkpoint(str(standin(name)), trust_remote_code=True)
    assert not trusted.remote and trusted == resolve_checkpoint(str(standin(name)), trust_remote_code=False)
    flags = {module.is_causal for module in loaded.model.modules() if hasattr(module, "is_causal")}
    assert flags == {not bidirectional}  # SDPA and flash attention read the modules' flag when no mask is passed


def test_llada_and_dream_configs_keep_their_real_fields(standin):
    llada = inspect_checkpoint(str(standin("llada-8b-instruct"))).config
    assert (llada.vocab_size, llada.rope_parameters["rope_theta"], llada.rms_norm_eps) == (126464, 500000.0, 1e-5)
    assert (llada.max_position_embeddings, llada.tie_word_embeddings, llada.is_causal) == (4096, False, False)
    assert (llada.bos_token_id, llada.eos_token_id, llada.pad_token_id) == (None, 126081, 126081)  # not Llama's 1, 2
    dream = inspect_checkpoint(str(standin("dream-v0-instruct-7b"))).config
    assert (dream.vocab_size, dream.rope_parameters["rope_theta"], dream.rms_norm_eps) == (152064, 1e6, 1e-6)
    assert (dream.mask_token_id, dream.is_causal) == (151666, False)


def test_each_decoder_fits_its_checkpoint_only(standin):
    check_model_fits("llada", str(standin("llada-8b-instruct")))
    check_model_fits("dream", str(standin("dream-v0-instruct-7b")))
    with pytest.raises(UserError, match="trained for LLaDA's unshifted logits"):
        check_model_fits("dream", str(standin("llada-8b-instruct")))
    with pytest.raises(UserError, match="needs a causal model"):
        check_model_fits("refusion", str(standin("dream-v0-instruct-7b")))


@pytest.fixture(scope="module")
def loaded_standin(standin):
    """``loaded_standin(name)``: the stand-in loaded in float32, once per module (the decoders only read it)."""
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_model(str(standin(name)), "cpu", torch.float32)
        return loaded[name]

    return get


@pytest.mark.parametrize("name, decoder, config", [  # each model plain or cached by default (the tiny models'
    # sweeps in tests/decoding/test_batched.py batch both ways); the other two under `make test-all`
    ("llada-8b-instruct", "llada", LLaDAConfig(gen_length=16, steps=8, block_length=8)),
    pytest.param("llada-8b-instruct", "llada", LLaDAConfig(gen_length=16, steps=8, block_length=8, use_cache=True),
                 marks=pytest.mark.slow),
    pytest.param("dream-v0-instruct-7b", "dream", DreamConfig(gen_length=16, steps=8, temperature=0.0),
                 marks=pytest.mark.slow),
    ("dream-v0-instruct-7b", "dream", DreamConfig(gen_length=16, steps=8, temperature=0.0, block_length=8,
                                                  use_cache=True)),
], ids=["llada", "llada-cache", "dream", "dream-cache"])
def test_a_batch_of_two_prompts_gives_each_its_batch_of_one_answer(loaded_standin, name, decoder, config):
    loaded = loaded_standin(name)
    prompts = [user_prompt_ids(loaded.tokenizer, question) for question in QUESTIONS]
    assert len(prompts[0]) != len(prompts[1])
    ids = dict(mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids)
    alone = [run_decoder(decoder, loaded.model, prompt, config, **ids) for prompt in prompts]
    together = run_decoder(decoder, loaded.model, prompts, config, batch_size=2, **ids)
    assert [result.tokens for result in together] == [result.tokens for result in alone]
    assert [result.stats.forwards for result in together] == [result.stats.forwards for result in alone]
    assert any(result.tokens for result in alone)


def copy_of(directory: Path, target: Path) -> Path:
    return Path(shutil.copytree(directory, target))


def test_a_config_with_an_auto_map_loads_with_one_pair_of_stock_classes(standin, tmp_path):
    """A ReFusion (Qwen3) config that carries an auto_map: transformers' own Qwen3 config and model, trusted or not."""
    directory = copy_of(standin("refusion"), tmp_path / "with-auto-map")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_refusion.ReFusionConfig",
                          "AutoModelForCausalLM": "modeling_refusion.ReFusionForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    for trust in (False, True):
        loaded = load_model(str(directory), "cpu", torch.float32, trust_remote_code=trust)
        assert (type(loaded.model.config).__name__, type(loaded.model).__name__) == ("Qwen3Config", "Qwen3ForCausalLM")


def test_an_auto_map_without_a_model_class_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mystery", "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig"}}))
    with pytest.raises(UserError, match="maps no model class in its config's auto_map"):
        load_model(str(tmp_path), "cpu", trust_remote_code=True)


def test_a_checkpoint_missing_a_weight_is_refused_not_filled_at_random(standin, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = copy_of(standin("llada-8b-instruct"), tmp_path / "incomplete")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    dropped = "model.transformer.blocks.1.up_proj.weight"
    shard = directory / index["weight_map"].pop(dropped)
    weights = load_file(str(shard))
    del weights[dropped]
    save_file(weights, str(shard), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"the checkpoint lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(directory), "cpu")


@pytest.mark.parametrize("field, value, message", [
    ("include_bias", True, "include_bias=True; loading it natively needs include_bias=False"),
    ("block_type", "sequential", "block_type='sequential'"),
    ("d_model", None, "lacks or garbles"),
])
def test_a_llada_config_the_mapping_does_not_carry_is_refused(standin, tmp_path, field, value, message):
    directory = copy_of(standin("llada-8b-instruct"), tmp_path / "changed")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        load_model(str(directory), "cpu")


def test_a_model_whose_attention_is_recorded_nowhere_is_bidirectional():
    """The authors' own masked-diffusion code carries no is_causal flag: the canvas masks are then full."""
    class Plain(torch.nn.Module):
        config = type("Config", (), {})()

    assert attends_causally(Plain()) is False


def test_llada_and_dream_load_and_decode_in_bfloat16(standin):
    """The dtype a GPU run uses: weights and logits in bf16, the samplers widen where their references do."""
    for name, decoder, config in (("llada-8b-instruct", "llada", LLaDAConfig(gen_length=8, steps=4, block_length=8)),
                                  ("dream-v0-instruct-7b", "dream", DreamConfig(gen_length=8, steps=4, temperature=0.0,
                                                                                top_p=None))):
        loaded = load_model(str(standin(name)), "cpu", torch.bfloat16)
        assert next(loaded.model.parameters()).dtype == torch.bfloat16
        prompt = user_prompt_ids(loaded.tokenizer, QUESTIONS[0])
        result = run_decoder(decoder, loaded.model, prompt, config, mask_token_id=loaded.mask_token_id,
                             eos_token_id=loaded.stop_token_ids)
        assert result.stats.forwards == 4 and loaded.mask_token_id not in result.tokens
