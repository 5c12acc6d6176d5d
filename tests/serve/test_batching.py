"""Step-level continuous batching: concurrent requests share model calls, and each gets exactly the answer
it gets alone (batch 1, in process), whether it arrived with the others or joined while they ran."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import read_jsonl
from refusion_cli.harness.suite import EVALS_DIR
from tests.serve.helpers import in_process, metric, running_server, scheduler, served

QUESTIONS = [problem["question"] for problem in read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[:16]]


@pytest.fixture(scope="module")
def refusion_tiny():
    return load_model("refusion-tiny", "cpu")


def chat(base: str, model: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": question}]}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120, verify=False)
    assert response.status_code == 200, response.text
    return response.json()


def test_sixteen_concurrent_requests_each_get_their_batch_one_answer(refusion_tiny):
    models = served(["refusion", "ar"])
    jobs = [("refusion" if i % 2 == 0 else "ar", question) for i, question in enumerate(QUESTIONS)]
    with running_server(refusion_tiny, models, max_batch=16) as (base, _):
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda job: chat(base, job[0], job[1], 48), jobs))
        text = httpx.get(f"{base}/metrics", verify=False).text
        assert metric(base, "refusion_running_rows") == 0
    assert metric_max_rows(text) > 1  # model calls with more than one row
    for (model, question), reply in zip(jobs, replies):
        text_alone, tokens, forwards = in_process(refusion_tiny, models[model], question, 48)
        assert reply["choices"][0]["message"]["content"] == text_alone
        assert (reply["usage"]["completion_tokens"], reply["usage"]["forwards"]) == (tokens, forwards)


def metric_max_rows(text: str) -> int:
    """The smallest bucket bound of ``refusion_batch_rows`` that holds every model call: the most rows a call had
    (exact for 1 and 2, the buckets' first bounds)."""
    buckets = [(float(line.split('le="')[1].split('"')[0]), float(line.split()[-1]))
               for line in text.splitlines() if line.startswith("refusion_batch_rows_bucket") and "+Inf" not in line]
    total = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("refusion_batch_rows_count")))
    assert total > 0
    return int(min(bound for bound, count in buckets if count >= total))


def test_a_request_joining_while_another_runs_gets_its_batch_one_answer(refusion_tiny):
    models = served(["refusion", "ar"])  # both run as sequences of one KV cache
    long_prompt, joining_question = "hello hello hello", QUESTIONS[1]  # AR runs to max_tokens on this prompt
    with running_server(refusion_tiny, models) as (base, state):
        body = {"model": "ar", "max_tokens": 256, "stream": True, "prompt": long_prompt}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120, verify=False) as response:
            lines = response.iter_lines()  # kept: closing this iterator closes the connection
            first = next(lines)
            assert scheduler(state).rows == 1  # the long one is decoding
            joined = chat(base, "refusion", joining_question, 64)
            assert scheduler(state).rows == 1  # the joining one came and went while the long one ran
            rest = [line for line in lines if line.startswith("data: ")]
        calls_with_two = httpx.get(f"{base}/metrics", verify=False).text
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in [first, *rest] if line != "data: [DONE]" and json.loads(line[6:])["choices"])
    assert joined["choices"][0]["message"]["content"] == in_process(refusion_tiny, models["refusion"],
                                                                    joining_question, 64)[0]
    assert streamed == in_process(refusion_tiny, models["ar"], long_prompt, 256, completion=True)[0]
    assert metric_max_rows(calls_with_two) == 2  # the joining row shared calls with the running one


def test_rows_wait_for_room_beyond_max_batch(refusion_tiny):
    models = served(["ar"])
    with running_server(refusion_tiny, models, max_batch=2) as (base, _):
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda q: chat(base, "ar", q, 24), QUESTIONS[:5]))
        text = httpx.get(f"{base}/metrics", verify=False).text
    assert metric_max_rows(text) == 2
    for question, reply in zip(QUESTIONS[:5], replies):
        assert reply["choices"][0]["message"]["content"] == in_process(refusion_tiny, models["ar"], question, 24)[0]


def test_health_reports_the_served_models(refusion_tiny):
    with running_server(refusion_tiny, served(["refusion", "ar"])) as (base, _):
        health = httpx.get(f"{base}/health", verify=False).json()
    assert health == {"status": "ok", "models": ["refusion", "ar"],
                      "checkpoints": {"refusion": "test-model", "ar": "test-model"}, "running_rows": 0,
                      "queue_depth": 0}
