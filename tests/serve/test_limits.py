"""What a request bounds and asks of the sampler, for every decoder the server serves, each on its own embedded
model: no answer holds more than ``max_tokens`` tokens (ReFusion's last slot is cut there, ``finish_reason``
"length"), streamed or not alike; ``temperature`` reaches the decoders that sample, and a ``seed`` reproduces
the answer; the series of ``/metrics`` carry the model and decoder of each request."""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest

from refusion_cli.decoding.registry import DECODERS
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from tests.serve.helpers import ask, decode_alone, running_server, served

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
CHECKPOINTS = {"ar": "ar-tiny", "refusion": "refusion-tiny"}  # the masked-diffusion decoders: mdm-tiny
OPEN_PROMPT = "hello hello hello"  # the tiny models' answers to it vary with the seed at temperature 0.7


def checkpoint_of(decoder: str) -> str:
    return CHECKPOINTS.get(decoder, "mdm-tiny")


@pytest.fixture(scope="module")
def server():
    loaded = {name: load_model(name, "cpu") for name in ("ar-tiny", "refusion-tiny", "mdm-tiny")}
    models = {}
    for decoder in DECODERS:
        models.update(served([decoder], checkpoint=checkpoint_of(decoder)))
    with running_server(loaded, models) as (base, _):
        yield base, models, loaded


def chat(question: str = QUESTION, **fields) -> dict:
    return {"messages": [{"role": "user", "content": question}], **fields}


# `make test-all`: LLaDA and Dream plain as well; their Fast-dLLM rows (the same canvas, cached) run by default
@pytest.mark.parametrize("decoder", [pytest.param(name, marks=pytest.mark.slow) if name in ("llada", "dream")
                                     else name for name in DECODERS])
def test_no_answer_holds_more_than_max_tokens(server, decoder):
    """At 1, 7 and 20 tokens (slots of 4 or 8 round 7 and 20 up), chat (``max_completion_tokens``) and
    completions (``max_tokens``), streamed or not: at most that many tokens, the stream's text and usage those of
    the whole answer. D2F's blocks of 32 do not fit fewer tokens: it refuses them, naming block_size."""
    base, _, _ = server
    for max_tokens in (1, 7, 20):
        for is_chat, body in ((True, chat(model=decoder, max_completion_tokens=max_tokens)),
                              (False, {"model": decoder, "prompt": QUESTION, "max_tokens": max_tokens})):
            whole = ask(base, body, chat=is_chat, stream=False)
            streamed = ask(base, body, chat=is_chat, stream=True)
            if decoder.endswith("-d2f"):
                assert whole.status == streamed.status == 400 and "block_size" in whole.error["message"]
                continue
            assert whole.status == streamed.status == 200, (whole.error, streamed.error)
            assert whole.usage["completion_tokens"] == streamed.usage["completion_tokens"] <= max_tokens
            assert whole.texts == streamed.texts and whole.finish == streamed.finish
            if whole.usage["completion_tokens"] < max_tokens:
                assert whole.finish == {0: "stop"}


def test_a_refusion_slot_past_max_tokens_is_cut_with_finish_reason_length(server):
    base, models, loaded = server
    refusion = loaded["refusion-tiny"]
    ids = refusion.tokenizer(OPEN_PROMPT, add_special_tokens=False)["input_ids"]
    alone = decode_alone(refusion, models["refusion"], ids, 7)
    assert len(alone.tokens) == 8  # whole slots: one token past the limit before the cut
    for stream in (False, True):
        reply = ask(base, {"model": "refusion", "prompt": OPEN_PROMPT, "max_tokens": 7}, chat=False, stream=stream)
        assert reply.usage["completion_tokens"] == 7 and reply.finish == {0: "length"}
        assert reply.texts == {0: refusion.tokenizer.decode(alone.tokens[:7], skip_special_tokens=True)}


@pytest.mark.parametrize("decoder", ["ar", "refusion"])
def test_temperature_samples_and_a_seed_reproduces_the_answer(server, decoder):
    base, models, loaded = server
    answers = {}
    for seed in range(4):
        body = chat(OPEN_PROMPT, model=decoder, max_tokens=24, temperature=0.7, seed=seed)
        first, again = (ask(base, body, chat=True, stream=stream) for stream in (False, True))
        assert first.status == 200, first.error
        assert first.texts == again.texts  # the same seed, the same answer, streamed or not
        answers[seed] = first.texts[0]
    assert len(set(answers.values())) > 1  # other seeds, other draws
    entry = models[decoder]
    model = loaded[checkpoint_of(decoder)]
    tuned = dataclasses.replace(entry, choice=dataclasses.replace(entry.choice, overrides={"temperature": 0.7}))
    alone = decode_alone(model, tuned, user_prompt_ids(model.tokenizer, OPEN_PROMPT), 24, seed=2)
    assert answers[2] == model.tokenizer.decode(alone.tokens, skip_special_tokens=True)  # the decoder's own draw


def test_top_p_reaches_ar_and_a_decoder_without_it_says_why(server):
    base, _, _ = server
    reply = ask(base, chat(model="ar", max_tokens=8, temperature=0.7, top_p=0.5, seed=1), chat=True, stream=False)
    assert reply.status == 200, reply.error
    for decoder in ("refusion", "llada"):
        refused = ask(base, chat(model=decoder, max_tokens=8, top_p=0.5), chat=True, stream=False)
        assert refused.status == 400 and refused.error["param"] == "top_p"
        assert f"the {decoder} decoder has no 'top_p'" in refused.error["message"]


def test_metrics_carry_the_model_and_decoder_of_each_request(server):
    base, _, _ = server
    assert ask(base, chat(model="ar", max_tokens=4), chat=True, stream=False).status == 200
    text = httpx.get(f"{base}/metrics", verify=False).text
    ok = re.search(r'^refusion_requests_total\{decoder="ar",model="ar-tiny",outcome="ok"\} (\S+)$', text, re.M)
    assert ok and float(ok.group(1)) >= 1
    assert re.search(r'^refusion_generated_tokens_total\{decoder="refusion",model="refusion-tiny"\} ', text, re.M)
    assert re.search(r'^refusion_model_calls_total\{model="mdm-tiny"\} ', text, re.M)


def test_tokenize_names_the_model_when_there_are_several_checkpoints(server):
    base, _, loaded = server
    refused = httpx.post(f"{base}/tokenize", json={"prompt": QUESTION}, verify=False)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    reply = httpx.post(f"{base}/tokenize", json={"model": "llada", "prompt": QUESTION, "add_special_tokens": False},
                       verify=False)
    assert reply.json()["tokens"] == loaded["mdm-tiny"].tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
