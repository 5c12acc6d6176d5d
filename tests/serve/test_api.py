"""``refusion serve`` through the official ``openai`` client: every decoder, chat and completions, streamed and
not, answers exactly what the decoder answers in process at batch 1; the stream's text joined is the answer."""

from __future__ import annotations

import pytest
from openai import OpenAI

from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import read_jsonl
from refusion_cli.harness.suite import EVALS_DIR
from tests.serve.helpers import in_process, running_server, served

QUESTIONS = [problem["question"] for problem in read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[:3]]
MAX_TOKENS = 32
CAUSAL = ["refusion", "ar"]
MASKED = ["llada", "llada-fast-dllm", "dream", "dream-fast-dllm", "llada-d2f", "dream-d2f"]
MASKED_BY_DEFAULT = ["llada-fast-dllm", "dream-d2f"]


@pytest.fixture(scope="module")
def refusion_tiny():
    return load_model("refusion-tiny", "cpu")


@pytest.fixture(scope="module")
def masked_model():
    """The embedded masked-diffusion model (LLaDA-style); the Dream and D2F decoders run on it too, as here they
    only need to decode the same tokens served and in process."""
    return load_model("mdm-tiny", "cpu")


def ask_all_four_ways(client: OpenAI, model: str, question: str) -> dict[str, tuple[str, str | None, object]]:
    """(text, finish_reason, usage) of chat and completions, streamed and not."""
    answers = {}
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=MAX_TOKENS)
    answers["chat"] = (reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    answers["chat stream"] = ("".join(parts), finish, usage)
    reply = client.completions.create(model=model, prompt=question, max_tokens=MAX_TOKENS)
    answers["completion"] = (reply.choices[0].text, reply.choices[0].finish_reason, reply.usage)
    parts, finish = [], None
    for chunk in client.completions.create(model=model, prompt=question, max_tokens=MAX_TOKENS, stream=True):
        for choice in chunk.choices:
            parts.append(choice.text)
            finish = choice.finish_reason or finish
    answers["completion stream"] = ("".join(parts), finish, None)
    return answers


# by default one Fast-dLLM and one D2F row of the masked-diffusion kind (the engine serves them all alike); the other
# four under `make test-all`
@pytest.mark.parametrize("decoders,fixture", [
    (CAUSAL, "refusion_tiny"), (MASKED_BY_DEFAULT, "masked_model"),
    pytest.param([name for name in MASKED if name not in MASKED_BY_DEFAULT], "masked_model", marks=pytest.mark.slow)])
def test_every_decoder_answers_as_in_process_streamed_or_not(decoders, fixture, request):
    loaded = request.getfixturevalue(fixture)
    models = served(decoders, variants=[(False, False, True)] if "refusion" in decoders else [])
    with running_server(loaded, models) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        assert sorted(model.id for model in client.models.list()) == sorted(models)
        for model_id, entry in models.items():
            question = QUESTIONS[0]
            answers = ask_all_four_ways(client, model_id, question)
            text, tokens, forwards = in_process(loaded, entry, question, MAX_TOKENS)
            assert answers["chat"][0] == text, model_id
            assert answers["chat stream"][0] == text, model_id  # the deltas joined are the answer
            assert answers["chat"][1] == answers["chat stream"][1] in ("stop", "length")
            for usage in (answers["chat"][2], answers["chat stream"][2]):
                assert usage.completion_tokens == tokens
                assert usage.model_extra["forwards"] == forwards
                assert usage.model_extra["tokens_per_forward"] == pytest.approx(tokens / forwards, abs=1e-4)
            completion, _, _ = in_process(loaded, entry, question, MAX_TOKENS, completion=True)
            assert answers["completion"][0] == answers["completion stream"][0] == completion, model_id


def test_stream_commits_cover_the_response_and_text_only_grows(refusion_tiny):
    """The commits extension names every committed offset once, with ReFusion's kinds; text is appended only."""
    import httpx
    import json

    models = served(["refusion"])
    with running_server(refusion_tiny, models) as (base, _):
        body = {"model": "refusion", "max_tokens": 64, "stream": True,
                "messages": [{"role": "user", "content": QUESTIONS[1]}]}
        offsets, kinds, text = [], set(), ""
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60, verify=False) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            for commit in chunk.get("commits", []):
                offsets.append(commit["offset"])
                kinds.add(commit["kind"])
            text += chunk["choices"][0]["delta"].get("content", "")
    answer, tokens, _ = in_process(refusion_tiny, models["refusion"], QUESTIONS[1], 64)
    assert text == answer
    assert len(offsets) == len(set(offsets)) >= tokens  # every offset once (ReFusion may commit past the EOS)
    assert set(range(tokens)) <= set(offsets)
    assert kinds <= {"first", "verified", "forced"} and "first" in kinds


def test_stop_strings_cut_the_answer_and_the_stream_alike(refusion_tiny):
    models = served(["ar"])
    with running_server(refusion_tiny, models) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        full, _, _ = in_process(refusion_tiny, models["ar"], QUESTIONS[2], MAX_TOKENS)
        stop = full.strip()[3:5]  # two characters from inside the answer
        cut, _, _ = in_process(refusion_tiny, models["ar"], QUESTIONS[2], MAX_TOKENS, stops=[stop])
        assert len(cut) < len(full)
        messages = [{"role": "user", "content": QUESTIONS[2]}]
        reply = client.chat.completions.create(model="ar", messages=messages, max_tokens=MAX_TOKENS, stop=stop)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (cut, "stop")
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="ar", messages=messages, max_tokens=MAX_TOKENS, stop=[stop], stream=True) if chunk.choices)
        assert streamed == cut


def test_decoder_options_reach_the_config_and_bad_ones_name_the_field(refusion_tiny):
    models = served(["refusion"])
    with running_server(refusion_tiny, models) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        options = {"slot_size": 4, "token_threshold": 0.5}
        reply = client.chat.completions.create(model="refusion", messages=messages, max_tokens=MAX_TOKENS,
                                               extra_body={"decoder_options": options})
        entry = models["refusion"]
        import dataclasses
        tuned = dataclasses.replace(entry, choice=dataclasses.replace(entry.choice, overrides=options))
        assert reply.choices[0].message.content == in_process(refusion_tiny, tuned, QUESTIONS[0], MAX_TOKENS)[0]
        from openai import BadRequestError
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(model="refusion", messages=messages, max_tokens=MAX_TOKENS,
                                           extra_body={"decoder_options": {"slot_threshold": 1.5}})
        assert "slot_threshold" in refused.value.body["message"]
        assert refused.value.body["param"] == "decoder_options"
