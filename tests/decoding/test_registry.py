"""The decoder table every front end uses."""

import pytest

from refusion_cli.decoding.registry import DECODERS, build_config, default_model
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.errors import UserError
from refusion_cli.models import load_model
from refusion_cli.models.chat import user_prompt_ids


def test_every_decoder_builds_its_config_from_strings():
    assert build_config("refusion", {"slot_size": "16", "block_size": "64"}).slot_size == 16
    assert build_config("ar", {"gen_length": "64"}).gen_length == 64
    assert build_config("llada", {"steps": "64", "gen_length": "64", "block_length": "32"}).steps == 64
    assert build_config("dream", {"alg": "maskgit_plus"}).alg == "maskgit_plus"
    assert build_config("llada-d2f", {"skip_threshold": "0.5", "top_p": "none"}).skip_threshold == 0.5
    with pytest.raises(UserError, match="unknown LLaDAConfig option"):
        build_config("llada", {"slot_size": "8"})
    with pytest.raises(UserError, match="unknown decoder 'beam'"):
        build_config("beam")


def test_default_models_follow_the_embedded_ones():
    assert [default_model(name) for name in ("refusion", "ar", "llada")] == ["refusion-tiny", "ar-tiny", "mdm-tiny"]
    with pytest.raises(UserError, match="no embedded model"):
        default_model("dream")


def test_run_decoder_on_a_checkpoint_directory(causal_checkpoint, bidirectional_checkpoint):
    causal = load_model(str(causal_checkpoint), device="cpu")
    mdm = load_model(str(bidirectional_checkpoint), device="cpu")
    assert not causal.bidirectional and mdm.bidirectional
    prompt = user_prompt_ids(causal.tokenizer, "Mia has 3 apples. She buys 4 more. How many apples does she have?")
    assert prompt[0] == causal.tokenizer.convert_tokens_to_ids("<|im_start|>")
    for name, loaded, overrides in [("refusion", causal, {"gen_length": "16", "slot_size": "4"}),
                                    ("ar", causal, {"gen_length": "16"}),
                                    ("llada", mdm, {"gen_length": "16", "steps": "16", "block_length": "8"}),
                                    ("dream", mdm, {"gen_length": "16", "steps": "16"}),
                                    ("llada-fast-dllm", mdm, {"gen_length": "16", "block_length": "8"}),
                                    ("dream-fast-dllm", mdm, {"gen_length": "16", "block_length": "8"}),
                                    ("llada-d2f", mdm, {"gen_length": "16", "block_size": "8"}),
                                    ("dream-d2f", mdm, {"gen_length": "16", "block_size": "8"})]:
        result = run_decoder(name, loaded.model, prompt, build_config(name, overrides),
                             mask_token_id=loaded.mask_token_id, eos_token_id=loaded.eos_token_id)
        assert 1 <= result.stats.tokens <= 16 and result.stats.forwards >= 1
        assert loaded.mask_token_id not in result.tokens
    assert set(DECODERS) == {"refusion", "ar", "llada", "dream", "llada-fast-dllm", "dream-fast-dllm", "llada-d2f",
                             "dream-d2f"}


def test_length_settings_follow_gen_length_unless_given():
    from refusion_cli.decoding.registry import length_settings

    assert length_settings("llada", 64) == {"steps": 64, "block_length": 32}
    assert length_settings("llada", "48") == {"steps": 48, "block_length": 48}  # 32 does not divide 48: one block
    assert length_settings("llada", 64, explicit={"block_length"}) == {"steps": 64}
    assert length_settings("dream", 16) == {"steps": 16}
    assert length_settings("refusion", 64) == length_settings("ar", 64) == {}
    assert length_settings("dream-fast-dllm", 64) == length_settings("llada-fast-dllm", 64) == \
        {"steps": 64, "block_length": 32}  # Fast-dLLM's blocks of 32, where 32 divides the budget
    assert length_settings("dream-fast-dllm", 24) == {"steps": 24, "block_length": 24}
    assert length_settings("llada", "many") == length_settings("llada", 0) == {}  # build_config refuses these


@pytest.mark.parametrize("decoder", ["llada", "dream"])
def test_the_fast_dllm_preset_is_table_1s_setting_for_any_budget(decoder):
    """Threshold 0.9, blocks of 32, prefix and dual cache, greedy; a benchmark's budget and the steps that follow
    it (length_settings) give a valid config, as do overrides on top."""
    from refusion_cli.decoding.registry import with_length

    preset = DECODERS[decoder].presets["fast-dllm"]
    assert (preset.gen_length, preset.threshold, preset.use_cache, preset.dual_cache) == (512, 0.9, True, True)
    assert preset.block_length == 32 and preset.temperature == 0.0
    for budget in (512, 256, 192):
        config = build_config(decoder, with_length(decoder, {"gen_length": budget}), base=preset)
        assert (config.gen_length, config.steps, config.block_length, config.dual_cache) == (budget, budget, 32, True)
    assert build_config(decoder, {"dual_cache": "false"}, base=preset).use_cache is True
    with pytest.raises(UserError, match="dual_cache extends the prefix cache"):
        build_config(decoder, {"use_cache": "false"}, base=preset)
    if decoder == "dream":
        assert (preset.alg, preset.top_p) == ("maskgit_plus", None)  # ranked by the top probability, argmax
    # the Fast-dLLM decoder of Table 1's row starts from this preset, and so runs beside the plain decoder
    fast = f"{decoder}-fast-dllm"
    assert build_config(fast, with_length(fast, {"gen_length": 256})) == \
        build_config(decoder, with_length(decoder, {"gen_length": 256}), base=preset)
    assert build_config(fast, {"dual_cache": "false"}) == build_config(decoder, {"dual_cache": "false"}, base=preset)
