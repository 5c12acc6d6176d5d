"""D2F's LoRA adapters (stand-ins) on the native LLaDA and Dream loads: both ways of naming them, the name
mapping onto the stock classes, the fingerprint, the decoder checks, a command, and every bad input as one
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from refusion_cli.errors import UserError
from refusion_cli.harness.runner import model_fingerprint
from refusion_cli.models import load_model
from refusion_cli.models.loading import check_model_fits
from tests.standins.helpers import run
from tools.standins import ADAPTERS, LORA_RANK

FAMILIES = {"llada": ("llada-8b-instruct", "d2f-llada-lora", "LlamaForCausalLM"),
            "dream": ("dream-v0-instruct-7b", "d2f-dream-lora", "Qwen2ForCausalLM")}
IDS = torch.tensor([[5, 17, 300, 4000, 9, 22, 1000, 7]])


def lora_layers(model: torch.nn.Module) -> list[str]:
    """The names of the modules that carry a LoRA pair."""
    return sorted(name for name, module in model.named_modules() if isinstance(getattr(module, "lora_A", None),
                                                                               torch.nn.ModuleDict))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_adapter_loads_by_its_folder_or_with_its_base_and_changes_the_logits(standin, family):
    base_name, adapter_name, model_class = FAMILIES[family]
    base, adapter = standin(base_name), standin(adapter_name)
    bare = load_model(str(base), "cpu", torch.float32)
    by_folder = load_model(str(adapter), "cpu", torch.float32)  # the base from its adapter_config.json
    with_base = load_model(f"{base}+{adapter}", "cpu", torch.float32)
    for loaded in (by_folder, with_base):
        assert type(loaded.model).__name__ == model_class  # still transformers' class, LoRA layers inside
        assert (loaded.adapter, loaded.source, loaded.shifted) == (str(adapter), str(base), family == "dream")
        assert (loaded.mask_token_id, loaded.stop_token_ids) == (bare.mask_token_id, bare.stop_token_ids)
        assert loaded.tokenizer is bare.tokenizer  # the base's files, read once: an adapter changes the weights only
    with torch.no_grad():
        plain, one, other = (loaded.model(input_ids=IDS).logits for loaded in (bare, by_folder, with_base))
    assert torch.equal(one, other)
    assert (one - plain).abs().max() > 0.1  # the adapter is applied, not loaded beside the model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_into_the_weights_the_adapter_decodes_the_same_tokens(standin, family):
    """peft's unmerged LoRA (as loaded) and the same adapter merged into the base weights (peft's merge) give the
    D2F decoder the same tokens."""
    from peft.tuners.lora import LoraLayer

    from refusion_cli.decoding.registry import build_config
    from refusion_cli.decoding.engine import run_decoder

    base_name, adapter_name, _ = FAMILIES[family]
    loaded = load_model(f"{standin(base_name)}+{standin(adapter_name)}", "cpu", torch.float64)
    decoder = f"{family}-d2f"
    config = build_config(decoder, {"gen_length": "16", "block_size": "8", "block_add_threshold": "0.1",
                                    "decoded_token_threshold": "0.5", "skip_threshold": "0.00003"})
    prompts = [IDS[0].tolist(), IDS[0, :3].tolist()]

    def decode() -> list[list[int]]:
        return [result.tokens for result in run_decoder(decoder, loaded.model, prompts, config,
                                                        mask_token_id=loaded.mask_token_id,
                                                        eos_token_id=loaded.eos_token_id)]

    unmerged = decode()
    layers = [module for module in loaded.model.modules() if isinstance(module, LoraLayer)]
    assert layers and not any(layer.merged for layer in layers)
    for layer in layers:
        layer.merge()
    assert decode() == unmerged and all(len(tokens) > 1 for tokens in unmerged)


def test_llada_names_map_onto_llamas(standin):
    """LLaDA's q_proj, k_proj, v_proj and attn_out of each block are Llama's self_attn.{q,k,v,o}_proj."""
    loaded = load_model(str(standin("d2f-llada-lora")), "cpu", torch.float32)
    assert lora_layers(loaded.model) == [
        f"model.layers.{layer}.self_attn.{part}" for layer in (0, 1) for part in ("k_proj", "o_proj", "q_proj",
                                                                                 "v_proj")]
    o_proj = loaded.model.model.layers[1].self_attn.o_proj
    weights = load_file(str(standin("d2f-llada-lora") / "adapter_model.safetensors"))
    assert torch.equal(o_proj.lora_B["default"].weight,
                       weights["base_model.model.model.transformer.blocks.1.attn_out.lora_B.weight"])
    assert o_proj.scaling["default"] == 1.0 and o_proj.r["default"] == LORA_RANK  # alpha 32 / r 32


def test_the_lora_weights_take_the_models_dtype(standin):
    loaded = load_model(str(standin("d2f-dream-lora")), "cpu", torch.bfloat16)
    assert {parameter.dtype for parameter in loaded.model.parameters()} == {torch.bfloat16}


def test_the_fingerprint_covers_the_adapter(standin, tmp_path):
    base, adapter = standin("llada-8b-instruct"), Path(shutil.copytree(standin("d2f-llada-lora"), tmp_path / "lora"))
    both = model_fingerprint(f"{base}+{adapter}")
    assert both == model_fingerprint(str(adapter)) != model_fingerprint(str(base))
    assert both.startswith(model_fingerprint(str(base)) + "+")
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({name: tensor * 2 for name, tensor in weights.items()}, str(adapter / "adapter_model.safetensors"))
    assert model_fingerprint(str(adapter)) != both


def test_the_d2f_decoders_fit_their_families_only(standin):
    llada = f"{standin('llada-8b-instruct')}+{standin('d2f-llada-lora')}"
    dream = str(standin("d2f-dream-lora"))
    check_model_fits("llada-d2f", llada)
    check_model_fits("dream-d2f", dream)
    with pytest.raises(UserError, match="trained for LLaDA's unshifted logits") as caught:
        check_model_fits("dream-d2f", llada)
    assert caught.value.hint == "use the llada-d2f decoder for it"


def test_chat_decodes_with_d2f_on_base_plus_adapter(standin, monkeypatch, capsys):
    model = f"{standin('llada-8b-instruct')}+{standin('d2f-llada-lora')}"
    code, out, err = run(monkeypatch, capsys, "chat", "--decoder", "llada-d2f", "--model", model, "--device", "cpu",
                         "--set", "gen_length=8", "--set", "block_size=4", "--prompt", "What is 12 + 7?")
    assert code == 0, err
    assert out.strip() and "tokens/forward" in out + err


@pytest.mark.slow  # 9 s: an eval run, twice
def test_eval_runs_d2f_on_base_plus_adapter_and_reuses_its_journal(standin, monkeypatch, capsys, tmp_path):
    model = f"{standin('llada-8b-instruct')}+{standin('d2f-llada-lora')}"
    arguments = ["eval", "--task", "synthetic", "--decoder", "llada-d2f", "--model", model, "--device", "cpu",
                 "--set", "gen_length=8", "--set", "block_size=4", "--limit", "1", "--output", str(tmp_path / "eval")]
    code, _, err = run(monkeypatch, capsys, *arguments)
    assert code == 0, err
    summary = (tmp_path / "eval" / "summary.md").read_text(encoding="utf-8")
    assert f"llada-d2f:{standin('d2f-llada-lora').name}" in summary
    code, out, err = run(monkeypatch, capsys, *arguments)
    assert code == 0, err
    assert "1 of 1 samples already done" in out + err  # its key (the fingerprint, adapter included) is stable


# ---------------------------------------------------------------------------------------------
# bad input, one line each


def copy_of(standin, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(standin(name), tmp_path / name))


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))


def refused(name: str, match: str) -> UserError:
    with pytest.raises(UserError, match=match) as caught:
        load_model(name, "cpu", torch.float32)
    assert "\n" not in str(caught.value)
    return caught.value


@pytest.mark.parametrize("family, other", [("llada", "dream"), ("dream", "llada")])
def test_an_adapter_of_another_family_is_refused(standin, family, other):
    adapter = standin(FAMILIES[family][1])
    target = {"llada": "attn_out", "dream": "o_proj"}[family]
    base_label = {"llada": "LLaDA", "dream": "Dream"}[other]
    error = refused(f"{standin(FAMILIES[other][0])}+{adapter}",
                    f"targets {target}, which the {base_label} base has no module of")
    assert error.hint == "the adapter was made for another model family"


def test_an_adapter_whose_base_is_not_here_names_it_and_the_way_out(standin, tmp_path):
    adapter = copy_of(standin, "d2f-llada-lora", tmp_path)
    edit_config(adapter, base_model_name_or_path=str(tmp_path / "LLaDA-8B-Instruct"))
    error = refused(str(adapter), f"the adapter '{adapter}' is for '{tmp_path / 'LLaDA-8B-Instruct'}', which cannot "
                                  "be loaded: no such checkpoint directory")
    assert error.hint == f"give the base with it: --model BASE+{adapter}"
    edit_config(adapter, base_model_name_or_path=None)
    assert refused(str(adapter), "names no base model").hint == f"give the base with it: --model BASE+{adapter}"


def test_missing_or_damaged_adapter_files_are_refused(standin, tmp_path):
    base = standin("llada-8b-instruct")
    adapter = copy_of(standin, "d2f-llada-lora", tmp_path)
    (adapter / "adapter_model.safetensors").unlink()
    refused(f"{base}+{adapter}", r"has no weights \(adapter_model.safetensors or adapter_model.bin\)")
    (adapter / "adapter_config.json").unlink()
    refused(f"{base}+{adapter}", "has no adapter_config.json")
    refused(f"{base}+{tmp_path / 'nowhere'}", "no such adapter folder")
    refused(f"{base}+{adapter}+{adapter}", r"BASE\+ADAPTER takes one checkpoint and one adapter")


@pytest.mark.filterwarnings("ignore:Unexpected keyword arguments")  # peft, reading LoRA's fields as IA3's
def test_adapter_weights_that_land_nowhere_or_do_not_fit_are_refused(standin, tmp_path):
    base = standin("llada-8b-instruct")
    adapter = copy_of(standin, "d2f-llada-lora", tmp_path)
    edit_config(adapter, target_modules=["q_proj"])  # the weights of k_proj, v_proj and attn_out have no layer
    refused(f"{base}+{adapter}", "has weights that land on no LoRA layer of the LLaDA base, e.g. ")
    adapter = copy_of(standin, "d2f-llada-lora", tmp_path / "narrow")
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.transformer.blocks.0.q_proj.lora_A.weight"
    weights[key] = weights[key][:, :8].contiguous()
    save_file(weights, str(adapter / "adapter_model.safetensors"))
    assert refused(f"{base}+{adapter}", "does not fit the LLaDA base").hint == ("the adapter was made for another "
                                                                                "model (family or size)")
    edit_config(adapter, modules_to_save=["lm_head"])
    refused(f"{base}+{adapter}", "sets modules_to_save, which loading onto the llada base's stock class")
    edit_config(adapter, modules_to_save=None, peft_type="IA3", target_modules=["q_proj"], feedforward_modules=[])
    refused(f"{base}+{adapter}", "is a IA3 adapter; only LoRA adapters load here")


def test_every_adapter_stand_in_targets_the_published_modules():
    assert {name: adapter.targets for name, adapter in ADAPTERS.items()} == {
        "d2f-llada-lora": ("q_proj", "k_proj", "v_proj", "attn_out"),
        "d2f-dream-lora": ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_llada_own_names_invert_the_key_mapping(standin):
    """Every LLaDA weight name, mapped onto Llama's, maps back to its own module name (what adapters name)."""
    import re

    from refusion_cli.models.layouts import LLADA_KEY_MAPPING, NATIVE_LAYOUTS

    index = json.loads((standin("llada-8b-instruct") / "model.safetensors.index.json").read_text())
    for name in index["weight_map"]:
        stock = next(re.sub(pattern, new, name) for pattern, new in LLADA_KEY_MAPPING.items() if re.match(pattern, name))
        assert NATIVE_LAYOUTS["llada"].own_module_name(stock.removesuffix(".weight")) == name.removesuffix(".weight")
