"""One registry entry adds a decoder everywhere: eval (its lm-eval model and answer rule), bench and its sweep,
chat and serve read every decoder from ``decoding.registry.DECODERS``, so a new entry is reachable from each
with no other table to edit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lm_eval.api.registry import get_model

from refusion_cli.bench.runner import BenchSettings, plan_entries
from refusion_cli.bench.sweep import MDM_GRID, SWEEP_GRIDS, grid, sweep_configs
from refusion_cli.chat.session import ChatSession
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding import registry
from refusion_cli.decoding.rows import shared_calls
from refusion_cli.decoding.spec import DecoderChoice
from refusion_cli.decoding.readback import Batched, Readback, read_all
from refusion_cli.harness import lm_adapters
from refusion_cli.harness.answers import SCRIPT_RULES, STOCK, answer_rule
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.models.loading import load_model


def test_every_registry_entry_is_an_lm_eval_model_with_answer_rules_and_a_sweep():
    for name, spec in registry.DECODERS.items():
        assert get_model(name) is lm_adapters.ADAPTERS[name] and lm_adapters.ADAPTERS[name].decoder == name
        assert answer_rule(name, EvalProtocol.PAPER) is SCRIPT_RULES[spec.answer_script]
        assert answer_rule(name, EvalProtocol.LM_EVAL) is STOCK
        assert grid(name) == SWEEP_GRIDS.get(spec.config_class, ())
        assert isinstance(DecoderChoice(name).config(), spec.config_class)  # eval, bench, chat, serve build it so


@pytest.fixture
def new_decoder(monkeypatch):
    """A decoder added by one registry entry: LLaDA's sampler under another name, on the embedded mdm-tiny."""
    spec = dataclasses.replace(registry.DECODERS["llada"], name="llada-copy", summary="LLaDA, registered again")
    monkeypatch.setitem(registry.DECODERS, "llada-copy", spec)
    return spec


def test_one_registry_entry_adds_a_decoder_everywhere(new_decoder):
    loaded = load_model("mdm-tiny", "cpu")
    prompt = [int(t) for t in loaded.tokenizer("Tom has 3 apples.", add_special_tokens=False)["input_ids"]]
    config = DecoderChoice("llada-copy").config(32)
    special = {"mask_token_id": loaded.mask_token_id, "eos_token_id": loaded.stop_token_ids}
    alone = run_decoder("llada-copy", loaded.model, prompt, config, **special)
    reference = run_decoder("llada", loaded.model, prompt, config, **special)
    assert alone.tokens == reference.tokens  # run_decoder (eval, bench, chat)

    # lm-eval: the adapter class the registry makes, registered under the new name
    adapter = lm_adapters.adapter_class(new_decoder)
    assert get_model("llada-copy") is adapter
    lm = adapter(pretrained="mdm-tiny", device="cpu", gen_length=32, warmed_up=True)
    assert lm.generate("Tom has 3 apples.").text == loaded.tokenizer.decode(alone.tokens, skip_special_tokens=True)
    assert answer_rule("llada-copy", EvalProtocol.PAPER).name == "eval_llada.py"

    # bench and its sweep
    entries = plan_entries(BenchSettings(decoders=("llada-copy",), gen_lengths=(32,), sweep=True, device="cpu"))
    assert [entry.decoder for entry in entries] == ["llada-copy"] * (1 + len(sweep_configs("llada-copy", config)))
    assert grid("llada-copy") == MDM_GRID

    # chat
    session = ChatSession(loaded, "llada-copy", {"gen_length": 32})
    assert session.ask("Tom has 3 apples.").tokens

    # serve: one row of the shared calls, the same tokens
    calls = shared_calls(registry.calls_kind("llada-copy"), loaded.model)
    options = registry.row_options("llada-copy", loaded.mask_token_id, loaded.stop_token_ids)
    program = new_decoder.open_row(calls, 0, torch.tensor(prompt), config, options, None, None, None)
    feed = next(program)
    try:
        while True:  # a model call for a feed, the host values for a readback (the engine's two kinds of wait)
            reply = read_all([feed])[0] if isinstance(feed, (Readback, Batched)) else calls.forward({0: feed})[0]
            feed = program.send(reply)
    except StopIteration as stop:
        assert stop.value.tokens == alone.tokens
