"""A model call that runs out of memory inside the server puts its rows back in the queue: every request still
gets its batch-1 answer, the event is counted in /metrics, and no request fails for it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from refusion_cli.decoding.cache import CausalRunner
from refusion_cli.harness.suite import EVALS_DIR
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import read_jsonl
from tests.memory import out_of_memory_above
from tests.serve.helpers import in_process, metric, running_server, scheduler, served

QUESTIONS = [problem["question"] for problem in read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[:6]]


@pytest.fixture(scope="module")
def refusion_tiny():
    return load_model("refusion-tiny", "cpu")


def test_a_call_out_of_memory_requeues_its_rows_and_every_request_gets_its_batch_one_answer(refusion_tiny,
                                                                                             monkeypatch):
    failed = out_of_memory_above(monkeypatch, CausalRunner, 2)  # a call of more than two rows does not fit
    models = served(["refusion"])
    body = lambda question: {"model": "refusion", "max_tokens": 48,  # noqa: E731
                             "messages": [{"role": "user", "content": question}]}
    with running_server(refusion_tiny, models, max_batch=16) as (base, state):
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda q: httpx.post(f"{base}/v1/chat/completions", json=body(q), timeout=120,
                                                         verify=False), QUESTIONS))
        requeues = metric(base, "refusion_oom_requeues_total")
        peak = scheduler(state).engine.counts.peak_rows
    assert failed and requeues == len(failed)  # every call of more than two rows failed, and was counted
    assert peak == 2  # then the engine went on with the rows that fit
    for question, reply in zip(QUESTIONS, replies):
        assert reply.status_code == 200, reply.text
        text_alone, tokens, forwards = in_process(refusion_tiny, models["refusion"], question, 48)
        answer = reply.json()
        assert answer["choices"][0]["message"]["content"] == text_alone
        assert (answer["usage"]["completion_tokens"], answer["usage"]["forwards"]) == (tokens, forwards)
