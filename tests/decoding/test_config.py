"""ReFusionConfig defaults, presets and construction from strings (CLI options, lm-eval model_args)."""

import pytest

from refusion_cli.decoding import PRESETS, ConfigError, ReFusionConfig, config_from_dict


def test_paper_defaults():
    config = ReFusionConfig()
    assert (config.gen_length, config.slot_size, config.slot_threshold, config.token_threshold) == (512, 8, 0.9, 0.9)
    assert config.block_tokens == 256  # gen_length / 2


def test_presets_hold_the_paper_settings():
    assert set(PRESETS) == {"mmlu_pro", "arc_challenge", "gsm8k", "math", "gpqa", "humaneval", "mbpp"}
    gsm8k = PRESETS["gsm8k"]
    assert (gsm8k.slot_size, gsm8k.block_size, gsm8k.slot_threshold, gsm8k.token_threshold) == (32, 128, 0.9, 0.4)
    assert (PRESETS["arc_challenge"].slot_size, PRESETS["arc_challenge"].token_threshold) == (8, 0.1)
    assert all(p.gen_length == 512 for p in PRESETS.values())


def test_config_from_strings_coerces_and_validates():
    config = config_from_dict(ReFusionConfig, {"slot_size": "16", "block_size": "64", "token_threshold": "0.3"},
                              base=PRESETS["gsm8k"])
    assert (config.slot_size, config.block_size, config.token_threshold, config.slot_threshold) == (16, 64, 0.3, 0.9)
    assert config_from_dict(ReFusionConfig, {"block_size": "none"}).block_size is None
    with pytest.raises(ConfigError, match="unknown ReFusionConfig option"):
        config_from_dict(ReFusionConfig, {"slot_treshold": "0.5"})
    with pytest.raises(ConfigError, match="cannot read 'abc' as float"):
        config_from_dict(ReFusionConfig, {"slot_threshold": "abc"})
    with pytest.raises(ConfigError, match=r"slot_threshold must be in \[0, 1\]"):
        config_from_dict(ReFusionConfig, {"slot_threshold": "2"})


def test_optional_fields_are_read_with_their_annotated_type():
    from refusion_cli.decoding.llada import LLaDAConfig

    config = config_from_dict(LLaDAConfig, {"threshold": "0.9", "use_cache": "true", "dual_cache": "yes",
                                            "remasking": "random"})
    assert (config.threshold, config.use_cache, config.dual_cache, config.remasking) == (0.9, True, True, "random")
    with pytest.raises(ConfigError, match="use_cache: cannot read 'maybe' as bool"):
        config_from_dict(LLaDAConfig, {"use_cache": "maybe"})


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
@pytest.mark.parametrize("decoder,option", [("refusion", "temperature"), ("llada", "temperature"),
                                            ("llada", "cfg_scale"), ("dream", "temperature"), ("dream", "alg_temp")])
def test_a_sampling_scale_must_be_a_finite_number_at_least_zero(decoder, option, value):
    # nan or inf used to pass the `< 0` check and reach the sampler (garbage tokens, no error)
    from refusion_cli.decoding.registry import build_config

    with pytest.raises(ConfigError, match=f"^{option} must be >= 0 and finite, got {float(value)}$"):
        build_config(decoder, {"gen_length": "32", option: value})


@pytest.mark.parametrize("decoder,option", [("refusion", "slot_threshold"), ("refusion", "gen_length"),
                                            ("ar", "gen_length"), ("llada", "steps"), ("dream", "temperature")])
@pytest.mark.parametrize("value", ["none", "NULL"])
def test_none_is_refused_for_a_field_that_cannot_be_none(decoder, option, value):
    # "none" used to become None for every field, and the check that followed raised a TypeError
    from refusion_cli.decoding.registry import build_config

    with pytest.raises(ConfigError, match=f"^{option}: cannot be '{value}'; it takes a (int|float)$"):
        build_config(decoder, {option: value})


def test_none_still_clears_an_optional_field():
    from refusion_cli.decoding.dream import DreamConfig

    config = config_from_dict(DreamConfig, {"top_p": "0.9", "top_k": "none", "threshold": "null"})
    assert (config.top_p, config.top_k, config.threshold) == (0.9, None, None)
