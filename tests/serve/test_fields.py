"""vLLM's request fields as the load tools and clients send them (chat and completions, streamed and not), each
against the decoder's batch-1 answer in process: ``ignore_eos`` (exactly ``max_tokens`` tokens), ``min_tokens``,
stop strings that end the row (its model calls saved), ``include_stop_str_in_output``, ``skip_special_tokens``,
``n``, ``max_completion_tokens``, ``stream_options.continuous_usage_stats``, the prompt forms of
``/v1/completions``, ``/tokenize``, and the neutral-only fields."""

from __future__ import annotations

import httpx
import pytest

from refusion_cli.harness.suite import EVALS_DIR
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import read_jsonl
from tests.serve.helpers import FIELD_MODES, ask, decode_alone, metric, running_server, served

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
# AR runs past 96 tokens without an end id on this question, chat or completion
LONG_PROMPT = next(p["question"] for p in read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")
                   if p["question"].startswith("Mia has 34 marbles."))


@pytest.fixture(scope="module")
def refusion_tiny():
    return load_model("refusion-tiny", "cpu")


@pytest.fixture(scope="module")
def server(refusion_tiny):
    models = served(["refusion", "ar"])
    with running_server(refusion_tiny, models) as (base, _):
        yield base, models


def body_of(model: str, chat: bool, prompt: str = QUESTION, **fields) -> dict:
    where = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {"model": model, **where, **fields}


def prompt_ids(loaded, chat: bool, prompt: str = QUESTION) -> list[int]:
    return user_prompt_ids(loaded.tokenizer, prompt) if chat else list(
        loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def text_of(loaded, tokens: list[int], skip_special: bool = True) -> str:
    return loaded.tokenizer.decode(tokens, skip_special_tokens=skip_special)


@pytest.mark.parametrize("chat,stream", FIELD_MODES)
@pytest.mark.parametrize("model", ["ar", "refusion"])
def test_ignore_eos_gives_exactly_max_tokens(server, refusion_tiny, model, chat, stream):
    base, models = server
    max_tokens = 13  # ReFusion's budget rounds up to 16 (two slots of 8): the answer is cut to 13
    reply = ask(base, body_of(model, chat, ignore_eos=True, max_tokens=max_tokens), chat=chat, stream=stream)
    assert reply.status == 200, reply.error
    alone = decode_alone(refusion_tiny, models[model], prompt_ids(refusion_tiny, chat), max_tokens, eos=())
    assert reply.usage["completion_tokens"] == max_tokens
    assert reply.texts == {0: text_of(refusion_tiny, alone.tokens[:max_tokens])}
    assert reply.finish == {0: "length"}


@pytest.mark.parametrize("chat,stream", FIELD_MODES)
def test_ignore_eos_runs_past_the_end_id_and_skip_special_tokens_shows_it(server, refusion_tiny, chat, stream):
    base, models = server
    ids = prompt_ids(refusion_tiny, chat)
    natural = decode_alone(refusion_tiny, models["ar"], ids, 48)
    assert natural.tokens[-1] in refusion_tiny.stop_token_ids and len(natural.tokens) < 40  # ends early alone
    max_tokens = len(natural.tokens) + 8
    fields = {"ignore_eos": True, "max_tokens": max_tokens, "skip_special_tokens": False}
    shown = ask(base, body_of("ar", chat, **fields), chat=chat, stream=stream)
    hidden = ask(base, body_of("ar", chat, **{**fields, "skip_special_tokens": True}), chat=chat, stream=stream)
    alone = decode_alone(refusion_tiny, models["ar"], ids, max_tokens, eos=())
    assert shown.texts[0] == text_of(refusion_tiny, alone.tokens, skip_special=False)
    assert hidden.texts[0] == text_of(refusion_tiny, alone.tokens)
    end_text = refusion_tiny.tokenizer.decode([natural.tokens[-1]])
    assert end_text in shown.texts[0] and end_text not in hidden.texts[0]


@pytest.mark.parametrize("chat,stream", FIELD_MODES)
def test_min_tokens_runs_past_an_early_end_id(server, refusion_tiny, chat, stream):
    base, models = server
    ids = prompt_ids(refusion_tiny, chat)
    natural = decode_alone(refusion_tiny, models["ar"], ids, 64)
    min_tokens = len(natural.tokens) + 4
    reply = ask(base, body_of("ar", chat, min_tokens=min_tokens, max_tokens=64), chat=chat, stream=stream)
    assert reply.status == 200, reply.error
    free = decode_alone(refusion_tiny, models["ar"], ids, 64, eos=()).tokens  # no end id ends it
    ends = [i for i, token in enumerate(free) if i >= min_tokens and token in refusion_tiny.stop_token_ids]
    expected = free[: ends[0] + 1] if ends else free
    assert reply.usage["completion_tokens"] == len(expected) >= min_tokens > len(natural.tokens)
    assert reply.texts[0] == text_of(refusion_tiny, expected[:-1] if ends else expected)
    assert reply.finish[0] == ("stop" if ends else "length")


@pytest.mark.parametrize("chat,stream", FIELD_MODES)
def test_a_stop_string_early_in_an_ar_answer_ends_the_row(server, refusion_tiny, chat, stream):
    """The row leaves the batch at the step whose token completes the stop string: its model calls are saved,
    not only its text cut."""
    base, models = server
    full = ask(base, body_of("ar", chat, LONG_PROMPT, max_tokens=96), chat=chat, stream=stream)
    assert full.usage["forwards"] == 96 and full.finish[0] == "length"
    text = full.texts[0]
    stop = text[8:11]
    assert stop and text.find(stop) >= 6
    for include in (False, True):
        fields = {"max_tokens": 96, "stop": [stop, "never seen"], "include_stop_str_in_output": include}
        cut = ask(base, body_of("ar", chat, LONG_PROMPT, **fields), chat=chat, stream=stream)
        end = text.find(stop) + (len(stop) if include else 0)
        assert (cut.texts[0], cut.finish[0]) == (text[:end], "stop")
        assert cut.usage["forwards"] < 96 / 4  # ended within a few tokens of the stop string
        assert cut.usage["completion_tokens"] == cut.usage["forwards"]  # AR: one token a call


def test_a_stop_string_ends_a_refusion_row_too(server, refusion_tiny):
    base, _ = server
    full = ask(base, body_of("refusion", False, LONG_PROMPT, max_tokens=128, ignore_eos=True), chat=False,
               stream=False)
    stop = full.texts[0][10:13]
    cut = ask(base, body_of("refusion", False, LONG_PROMPT, max_tokens=128, ignore_eos=True, stop=stop), chat=False,
              stream=True)
    assert cut.texts[0] == full.texts[0][: full.texts[0].find(stop)] and cut.finish[0] == "stop"
    assert cut.usage["forwards"] < full.usage["forwards"]


@pytest.mark.parametrize("chat,stream", FIELD_MODES)
def test_n_choices_are_rows_of_their_own_seeded_seed_plus_i(server, refusion_tiny, chat, stream):
    base, models = server
    fields = {"max_tokens": 24, "n": 3, "seed": 7, "decoder_options": {"temperature": 1.0}}
    reply = ask(base, body_of("refusion", chat, **fields), chat=chat, stream=stream)
    assert reply.status == 200, reply.error
    entry = models["refusion"]
    import dataclasses
    tuned = dataclasses.replace(entry, choice=dataclasses.replace(entry.choice, overrides={"temperature": 1.0}))
    alone = [decode_alone(refusion_tiny, tuned, prompt_ids(refusion_tiny, chat), 24, seed=7 + i) for i in range(3)]
    from refusion_cli.harness.answers import stock_text
    assert reply.texts == {i: stock_text(refusion_tiny.tokenizer, result.tokens, []) for i, result in enumerate(alone)}
    assert len(set(reply.texts.values())) > 1  # the seeds differ
    assert reply.usage["completion_tokens"] == sum(result.stats.tokens for result in alone)
    assert reply.usage["forwards"] == sum(result.stats.forwards for result in alone)
    assert reply.usage["prompt_tokens"] == len(prompt_ids(refusion_tiny, chat))  # the prompt counts once


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_every_prompt_form_one_choice_each_by_index(server, refusion_tiny, stream):
    base, models = server
    questions = [QUESTION, "Mia has 5 pens and loses 2. How many are left?"]
    ids = [prompt_ids(refusion_tiny, False, q) for q in questions]
    expected = {i: text_of(refusion_tiny, decode_alone(refusion_tiny, models["ar"], p, 24).tokens)
                for i, p in enumerate(ids)}
    for prompt, answers in ((questions[0], {0: expected[0]}), (questions, expected), (ids[1], {0: expected[1]}),
                            (ids, expected), ([ids[0], questions[1]], expected)):
        reply = ask(base, {"model": "ar", "prompt": prompt, "max_tokens": 24}, chat=False, stream=stream)
        assert reply.texts == answers, prompt
        assert reply.usage["prompt_tokens"] == sum(len(ids[i]) for i in answers) if len(answers) == 2 \
            else reply.usage["prompt_tokens"] in (len(ids[0]), len(ids[1]))
    two = ask(base, {"model": "ar", "prompt": questions, "max_tokens": 24, "n": 2}, chat=False, stream=stream)
    assert two.texts == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_stats_put_usage_on_every_chunk(server, chat):
    base, _ = server
    fields = {"max_tokens": 32, "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}
    reply = ask(base, body_of("refusion", chat, **fields), chat=chat, stream=True)
    counts = [usage["completion_tokens"] for usage in reply.chunk_usages]
    assert len(counts) == reply.chunks - 1  # every chunk but the last (usage alone) carries its own
    assert counts == sorted(counts) and counts[-1] == reply.usage["completion_tokens"] == 32
    # the diffusion figures: model calls, tokens per call and per chunk (a ReFusion step commits several)
    usage = reply.usage
    assert usage["tokens_per_forward"] == pytest.approx(32 / usage["forwards"], abs=1e-3)
    assert usage["stream_chunks"] >= 1 and usage["tokens_per_chunk"] > 1
    assert metric(base, "refusion_stream_chunks_total") >= usage["stream_chunks"]
    assert metric(base, "refusion_oom_requeues_total") == 0


def test_max_completion_tokens_is_max_tokens(server):
    base, _ = server
    for stream in (False, True):
        by_new = ask(base, body_of("ar", True, LONG_PROMPT, max_completion_tokens=10), chat=True, stream=stream)
        by_old = ask(base, body_of("ar", True, LONG_PROMPT, max_tokens=10), chat=True, stream=stream)
        assert by_new.texts == by_old.texts and by_new.usage["completion_tokens"] == 10


def test_neutral_values_are_taken_and_others_refused_saying_why(server):
    base, _ = server
    for chat in (True, False):
        ok = ask(base, body_of("ar", chat, max_tokens=4, top_k=-1, repetition_penalty=1.0, logprobs=None),
                 chat=chat, stream=False)
        assert ok.status == 200, ok.error
        assert ask(base, body_of("ar", chat, max_tokens=4, top_k=0), chat=chat, stream=True).status == 200
        for fields, param, words in (({"top_k": 5}, "top_k", "thresholds"),
                                     ({"repetition_penalty": 1.2}, "repetition_penalty", "only 1.0"),
                                     ({"logprobs": True if chat else 2}, "logprobs", "no log-probabilities"),
                                     ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "at most max_tokens"),
                                     ({"n": 0}, "n", "at least 1"),
                                     ({"stream_options": {"other": True}}, "stream_options", "continuous_usage")):
            refused = ask(base, body_of("ar", chat, **fields), chat=chat, stream=False)
            assert refused.status == 400 and refused.error["param"] == param and words in refused.error["message"]
    for prompt in ([], [[]], [1.5], [[1, 2], "x", 3], [10**9]):
        refused = ask(base, {"model": "ar", "prompt": prompt}, chat=False, stream=False)
        assert refused.status == 400 and refused.error["param"] == "prompt", prompt


def test_tokenize_answers_as_vllm(server, refusion_tiny):
    base, _ = server
    reply = httpx.post(f"{base}/tokenize", json={"model": "ar", "prompt": QUESTION, "add_special_tokens": False},
                       verify=False)
    assert reply.status_code == 200
    body = reply.json()
    assert body["tokens"] == prompt_ids(refusion_tiny, False) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == refusion_tiny.model.config.max_position_embeddings
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": QUESTION}]},
                      verify=False).json()
    assert chat["tokens"] == prompt_ids(refusion_tiny, True)


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_keeps_a_masked_diffusion_canvas_whole(stream):
    """LLaDA's canvas is the response: with ``ignore_eos`` every position of it is kept, end ids included."""
    mdm = load_model("mdm-tiny", "cpu")
    models = served(["llada"])
    with running_server(mdm, models) as (base, _):
        for chat in (True, False):
            reply = ask(base, body_of("llada", chat, ignore_eos=True, max_tokens=32), chat=chat, stream=stream)
            alone = decode_alone(mdm, models["llada"], prompt_ids(mdm, chat), 32, eos=())
            assert reply.usage["completion_tokens"] == 32 == len(alone.tokens)
            assert reply.texts == {0: text_of(mdm, alone.tokens)} and reply.finish == {0: "length"}
        # without it the completion's response is cut at its first end id
        assert len(decode_alone(mdm, models["llada"], prompt_ids(mdm, False), 32).tokens) < 32
