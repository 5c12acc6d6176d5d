"""lm-eval's sampling keys: a greedy request decodes, a request for sampling is refused (never answered greedily)."""

from __future__ import annotations

import pytest

from refusion_cli.errors import UserError

lm_adapters = pytest.importorskip("refusion_cli.harness.lm_adapters")
from lm_eval.api.instance import Instance  # noqa: E402


def generation(**gen_kwargs) -> Instance:
    return Instance("generate_until", {}, ("Mia has 3 apples.", gen_kwargs), 0, ("synthetic", 0, 1))


@pytest.fixture(scope="module")
def ar(causal_checkpoint):
    # warmed up: no untimed first decode, these tests count decodes
    return lm_adapters.ADAPTERS["ar"](pretrained=str(causal_checkpoint), device="cpu", gen_length=4, warmed_up=True)


@pytest.mark.parametrize("gen_kwargs", [
    {"do_sample": False},
    {"temperature": 0.0},
    {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": 0},  # what the suite's tasks send
    {"do_sample": False, "temperature": 0.7},  # lm-eval's HF model decodes this greedily too
    {"do_sample": "false", "temperature": "0.7"},  # as --gen_kwargs gives them
    {},
])
def test_greedy_settings_of_the_sampling_keys_decode(ar, gen_kwargs):
    before = len(ar.samples)
    [text] = ar.generate_until([generation(until=[], max_gen_toks=4, **gen_kwargs)])
    assert len(ar.samples) == before + 1 and ar.samples[-1].text == text


@pytest.mark.parametrize("gen_kwargs, asked", [
    ({"do_sample": True, "temperature": 0.8}, "do_sample=True, temperature=0.8"),
    ({"temperature": 0.2}, "temperature=0.2"),  # humaneval_64's setting: no do_sample, a temperature above 0
    ({"do_sample": "true"}, "do_sample=true"),
])
def test_a_request_for_sampling_is_refused_not_answered_greedily(ar, gen_kwargs, asked):
    before = len(ar.samples)
    with pytest.raises(UserError) as raised:
        ar.generate_until([generation(until=[], max_gen_toks=4, **gen_kwargs)])
    assert str(raised.value) == (f"the task asks for sampling ({asked}), but the ar adapter decodes as its config says "
                                 "and would answer greedily under a sampling task's name")
    assert len(ar.samples) == before  # nothing was decoded


def test_a_temperature_that_is_not_a_number_is_one_error(ar):
    with pytest.raises(UserError, match="generation key 'temperature' must be a number, got 'hot'"):
        ar.generate_until([generation(until=[], max_gen_toks=4, temperature="hot")])
