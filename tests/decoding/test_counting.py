"""One counting rule for AR, ReFusion, LLaDA, Dream and D2F, and the decoder <-> model family check.

The rule (decoding/stats.py): tokens = response tokens up to and including the first EOS,
forwards = every model call, TPF = tokens / forwards, TPS = tokens / seconds. The forwards are
checked against a counter hooked onto the model itself, not against the decoder's own count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

from refusion_cli.decoding import (
    ARConfig,
    D2FConfig,
    DecodeResult,
    DreamConfig,
    LLaDAConfig,
    ReFusionConfig,
    check_decoder_fits,
    run_decoder,
)
from refusion_cli.errors import UserError
from tests.tiny import MASK_ID

LLADA = LLaDAConfig(gen_length=16, steps=8, block_length=8)
DREAM = DreamConfig(gen_length=16, steps=8, alg="entropy", temperature=0.0, top_p=None)
D2F = D2FConfig(gen_length=16, block_size=4, block_add_threshold=0.25, decoded_token_threshold=0.5, skip_threshold=0.3)


def decode_with(decoder: str, config: Any) -> Callable[..., DecodeResult]:
    """``decode(model, prompt, eos_token_id=None)``: ``run_decoder`` with ``decoder`` and ``config``."""
    return lambda model, prompt, eos=None: run_decoder(decoder, model, prompt, config, mask_token_id=MASK_ID,
                                                       eos_token_id=eos)


# name -> (needs a bidirectional model, decode(model, prompt, eos_token_id) -> result)
DECODERS: dict[str, tuple[bool, Callable[..., DecodeResult]]] = {
    "ar": (False, decode_with("ar", ARConfig(gen_length=16))),
    "refusion": (False, decode_with("refusion", ReFusionConfig(gen_length=16, slot_size=4, block_size=8,
                                                               slot_threshold=0.3, token_threshold=0.3))),
    "llada": (True, decode_with("llada", LLADA)),
    "dream": (True, decode_with("dream", DREAM)),
    "llada-d2f": (True, decode_with("llada-d2f", D2F)),
    "dream-d2f": (True, decode_with("dream-d2f", D2F)),
}


def test_one_table_one_counting_rule(causal_model, bidirectional_model, prompt, record_calls):
    """Each decoder runs once without EOS; a token from the middle of that answer then plays EOS."""
    table: dict[str, dict[str, float | int]] = {}
    calls_of = {True: record_calls(bidirectional_model), False: record_calls(causal_model)}
    for name, (bidirectional, decode) in DECODERS.items():
        model, calls = (bidirectional_model if bidirectional else causal_model), calls_of[bidirectional]
        uncut = decode(model, prompt, None).tokens
        eos = uncut[len(uncut) // 2]
        calls.clear()
        result = decode(model, prompt, eos)
        stats = result.stats
        # tokens: up to and including the first EOS
        assert stats.tokens == len(result.tokens)
        assert result.tokens[-1] == eos and eos not in result.tokens[:-1], name
        if name != "refusion":  # EOS does not steer these decoders before it is emitted
            assert result.tokens == uncut[: uncut.index(eos) + 1], name
        # forwards and positions: every model call, as the model itself saw them
        assert stats.forwards == len(calls), name
        assert stats.positions == sum(call.numel() for call in calls), name
        assert stats.tpf == stats.tokens / stats.forwards and stats.tps == stats.tokens / stats.seconds
        assert 0 < stats.forward_seconds <= stats.seconds
        table[name] = stats.as_dict()
    columns = {"forwards", "tokens", "seconds", "tps", "tpf"}
    assert all(columns <= set(row) for row in table.values())
    assert table["ar"]["tpf"] == 1.0  # one token per forward, EOS included
    assert table["llada"]["forwards"] == LLADA.steps and table["dream"]["forwards"] == DREAM.steps


@pytest.mark.parametrize("name", list(DECODERS))
def test_several_eos_ids_end_a_response_at_the_first_of_any(causal_model, bidirectional_model, prompt, name):
    """Given (later, earlier) EOS ids, every decoder stops at the earlier one, as with that id alone."""
    bidirectional, decode = DECODERS[name]
    model = bidirectional_model if bidirectional else causal_model
    uncut = decode(model, prompt, None).tokens
    earlier = uncut[len(uncut) // 2]
    later = next(token for token in uncut[uncut.index(earlier) + 1:] if token not in uncut[:uncut.index(earlier) + 1])
    alone, both = decode(model, prompt, earlier), decode(model, prompt, (later, earlier))
    assert both.tokens == alone.tokens and both.tokens[-1] == earlier and later not in both.tokens
    assert both.stats.tokens == alone.stats.tokens == len(both.tokens)
    assert both.stats.forwards == alone.stats.forwards


@pytest.mark.parametrize(
    "decode",
    [
        decode_with("llada", dataclasses.replace(LLADA, cfg_scale=2.0)),
        decode_with("llada", dataclasses.replace(LLADA, cfg_scale=2.0, use_cache=True)),
        decode_with("llada", dataclasses.replace(LLADA, threshold=0.3, use_cache=True)),
        decode_with("dream", dataclasses.replace(DREAM, threshold=0.35, use_cache=True, block_length=8)),
        decode_with("llada", dataclasses.replace(LLADA, threshold=0.0, use_cache=True, dual_cache=True)),
        decode_with("dream", dataclasses.replace(DREAM, use_cache=True, dual_cache=True, block_length=8)),
    ],
    ids=["llada-cfg", "llada-cfg-cache", "llada-threshold-cache", "dream-threshold-cache", "llada-dual-cache",
         "dream-dual-cache"],
)
def test_every_model_call_is_a_forward(bidirectional_model, prompt, record_calls, decode):
    """Guidance's unconditional pass, the cache-filling pass and the cached passes all count (also a cached
    pass after a full pass that finished its block)."""
    calls = record_calls(bidirectional_model)
    result = decode(bidirectional_model, prompt)
    assert result.stats.forwards == len(calls) > 0
    assert result.stats.positions == sum(call.numel() for call in calls)
    assert result.stats.tpf == result.stats.tokens / len(calls)


# ---------------------------------------------------------------------------------------------
# decoder <-> model family


@pytest.mark.parametrize("decoder", ["llada", "dream"])
def test_masked_diffusion_decoders_refuse_a_causal_model(decoder):
    with pytest.raises(UserError, match=f"the {decoder} decoder needs a bidirectional"):
        check_decoder_fits(decoder, bidirectional=False)
    check_decoder_fits(decoder, bidirectional=True)
    check_decoder_fits(decoder, bidirectional=False, force=True)


@pytest.mark.parametrize("decoder", ["ar", "refusion"])
def test_causal_decoders_refuse_a_bidirectional_model(decoder):
    with pytest.raises(UserError, match=f"the {decoder} decoder needs a causal model"):
        check_decoder_fits(decoder, bidirectional=True)
    check_decoder_fits(decoder, bidirectional=False)
    check_decoder_fits(decoder, bidirectional=True, force=True)


def test_dream_and_llada_each_refuse_a_model_trained_for_the_other():
    # shifted: the checkpoint records Dream's objective (True) or LLaDA's (False); None: not recorded
    with pytest.raises(UserError, match="the llada decoder does not fit this model: it was trained for Dream's"):
        check_decoder_fits("llada", bidirectional=True, shifted=True)
    with pytest.raises(UserError, match="the dream decoder does not fit this model: it was trained for LLaDA's"):
        check_decoder_fits("dream", bidirectional=True, shifted=False)
    for decoder, shifted in (("llada", False), ("dream", True), ("llada", None), ("dream", None)):
        check_decoder_fits(decoder, bidirectional=True, shifted=shifted)
    check_decoder_fits("llada", bidirectional=True, shifted=True, force=True)
    with pytest.raises(UserError, match="needs a causal model"):
        check_decoder_fits("refusion", bidirectional=True, shifted=True)


def test_unknown_decoder_is_refused_even_with_force():
    with pytest.raises(UserError, match="unknown decoder 'mdlm'; choose one of refusion, ar, llada, dream"):
        check_decoder_fits("mdlm", bidirectional=True, force=True)


def test_decoders_accept_any_model_the_check_is_separate(causal_model, prompt):
    """The pairing check belongs to the CLI / harness; the sampler itself runs on a causal model."""
    result = run_decoder("llada", causal_model, prompt, LLADA, mask_token_id=MASK_ID, eos_token_id=None)
    assert len(result.tokens) == 16 and MASK_ID not in result.tokens
    assert result.stats.forwards == LLADA.steps


def test_time_in_the_on_step_callback_is_not_decode_time(causal_model, bidirectional_model, prompt, monkeypatch):
    """A slow live view must not lower the TPS it shows: its callback time is left out of ``seconds``.

    The clock is a fake one that only the callback moves, so decoding itself takes exactly 0 s.
    """
    import time

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def slow_view(step) -> None:
        clock[0] += 0.25

    runs = [
        lambda cb: run_decoder("refusion", causal_model, prompt,
                               ReFusionConfig(gen_length=8, slot_size=4, block_size=8),
                               mask_token_id=MASK_ID, eos_token_id=None, on_step=cb),
        lambda cb: run_decoder("llada", bidirectional_model, prompt, LLaDAConfig(gen_length=8, steps=4, block_length=8),
                               mask_token_id=MASK_ID, eos_token_id=None, on_step=cb),
    ]
    for run in runs:
        result = run(slow_view)
        assert len(result.trace) >= 1 and result.stats.callback_seconds == 0.25 * len(result.trace)
        assert result.stats.seconds == 0.0
        assert result.tokens == run(None).tokens


def test_model_calls_off_the_cpu_are_counted_without_a_synchronisation_each(monkeypatch):
    # On a GPU a sync around every call would stall the queue inside the timed decode; only the
    # decode call as a whole is synchronised. A "meta" tensor stands in for a GPU tensor here.
    import torch

    from refusion_cli.decoding import stats as stats_module

    def no_sync(device):
        raise AssertionError(f"synchronised {device} around a single model call")

    monkeypatch.setattr(stats_module, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    seen = []
    stats = stats_module.DecodeStats()
    input_ids = torch.empty(2, 5, dtype=torch.long, device="meta")
    out, seconds = stats_module.timed_call(lambda **inputs: seen.append(inputs) or "logits", input_ids=input_ids)
    stats_module.count_call(stats, input_ids.numel(), seconds)
    assert (out, len(seen), stats.forwards, stats.positions, stats.forward_seconds) == ("logits", 1, 1, 10, None)


def test_the_kv_cache_goes_to_the_keyword_the_models_forward_names():
    # transformers < 5.24 calls it past_key_values, later releases cache; the wrong name is swallowed
    # by **kwargs and the model silently runs without its cache
    from refusion_cli.decoding.stats import cache_argument

    class Current(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    class Earlier(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class KeywordsOnly(torch.nn.Module):
        def forward(self, **kwargs): ...

    class NoCache(torch.nn.Module):
        def forward(self, input_ids): ...

    cache = object()
    assert cache_argument(Current(), cache) == {"cache": cache}
    assert cache_argument(Earlier(), cache) == {"past_key_values": cache}
    assert cache_argument(KeywordsOnly(), cache) == {"cache": cache}
    with pytest.raises(TypeError, match="NoCache.forward takes no KV cache"):
        cache_argument(NoCache(), cache)
