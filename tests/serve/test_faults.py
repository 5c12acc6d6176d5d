"""Bad input and faults: each an OpenAI error object with its status, and the server goes on serving; a client
that leaves mid-stream frees its row; one request's failing decode fails that request only; a scheduler that
dies fails every open request and ends the process. (SIGTERM letting the running request finish, exit 0:
tests/serve/test_cli.py, on the server process started there.)"""

from __future__ import annotations

import dataclasses
import threading

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from refusion_cli.decoding import registry
from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.models.loading import load_model
from tests.serve.helpers import in_process, metric, running_server, scheduler, serve_process, served, wait_for

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
MESSAGES = [{"role": "user", "content": QUESTION}]
LONG = {"model": "ar", "prompt": "hello hello hello", "max_tokens": 512, "stream": True}  # 512 tokens: no EOS comes


@pytest.fixture(scope="module")
def refusion_tiny():
    return load_model("refusion-tiny", "cpu")


def post(base: str, body, path: str = "/v1/chat/completions", **kwargs) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{base}{path}", json=body, timeout=60, verify=False, **kwargs)
    return httpx.post(f"{base}{path}", content=body, timeout=60, headers={"content-type": "application/json"},
                      verify=False)


BAD_REQUESTS = [  # (body, status, param, words in the message)
    (b"{not json", 400, None, "not valid JSON"),
    ([1, 2], 400, None, "JSON object"),
    ({"messages": MESSAGES}, 400, "model", "'model' is required"),
    ({"model": "gpt-4", "messages": MESSAGES}, 404, "model", "'gpt-4' does not exist"),
    ({"model": "ar", "messages": "hello"}, 400, "messages", "must be an array"),
    ({"model": "ar", "messages": [{"content": "hi"}]}, 400, "messages[0]", "'role'"),
    ({"model": "ar", "messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens", "must be an integer"),
    ({"model": "ar", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"model": "ar", "messages": MESSAGES, "max_tokens": 5000}, 400, "max_tokens", "exceeds the model's context"),
    ({"model": "refusion", "messages": MESSAGES, "top_p": 0.9}, 400, "top_p", "Gumbel noise at 'temperature'"),
    ({"model": "ar", "messages": MESSAGES, "stream": "yes"}, 400, "stream", "true or false"),
    ({"model": "ar", "messages": MESSAGES, "n": 0}, 400, "n", "at least 1"),
    ({"model": "ar", "messages": MESSAGES, "best_of": 2}, 400, "best_of", "not supported"),
    ({"model": "ar", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"model": "ar", "messages": MESSAGES, "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ({"model": "refusion", "messages": MESSAGES, "decoder_options": {"slot_size": "big"}}, 400, "decoder_options",
     "slot_size"),
    ({"model": "refusion", "messages": MESSAGES, "decoder_options": {"warp": 9}}, 400, "decoder_options", "warp"),
]


def test_bad_requests_are_openai_errors_and_the_server_goes_on(refusion_tiny):
    with running_server(refusion_tiny, served(["refusion", "ar"])) as (base, _):
        for body, status, param, words in BAD_REQUESTS:
            response = post(base, body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param and words in error["message"], (body, error)
        assert post(base, {"model": "ar", "prompt": ["a", 5]}, "/v1/completions").status_code == 400
        assert httpx.get(f"{base}/v1/nothing", verify=False).json()["error"]["type"] == "not_found_error"
        reply = post(base, {"model": "ar", "messages": MESSAGES, "max_tokens": 8})
        assert reply.status_code == 200  # still serving


def test_an_api_key_is_required_when_set(refusion_tiny):
    with running_server(refusion_tiny, served(["ar"]), api_key="s3cret") as (base, _):
        body = {"model": "ar", "messages": MESSAGES, "max_tokens": 4}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, verify=False)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/v1/models", verify=False).status_code == 401
        ok = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"},
                        verify=False)
        assert ok.status_code == 200
        assert httpx.get(f"{base}/health", verify=False).status_code == 200  # probes need no key


def test_a_full_queue_answers_429_with_retry_after(refusion_tiny):
    with running_server(refusion_tiny, served(["refusion"]), max_batch=1, max_queue=1) as (base, state):
        long = {"model": "refusion", "messages": MESSAGES, "max_tokens": 192}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, base, long)
            wait_for(lambda: scheduler(state).rows == 1)
            waiting = pool.submit(post, base, long)
            wait_for(lambda: scheduler(state).depth == 1)
            refused = post(base, long)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert running.result().status_code == waiting.result().status_code == 200


def test_a_client_leaving_mid_stream_frees_its_row(refusion_tiny):
    with running_server(refusion_tiny, served(["ar"])) as (base, state):
        with httpx.stream("POST", f"{base}/v1/completions", json=LONG, timeout=60, verify=False) as response:
            lines = response.iter_lines()  # kept: closing this iterator closes the connection
            assert next(lines).startswith("data: ")
            # the gauge is set when the step that sent the first token returns, which may be just after it arrives
            wait_for(lambda: metric(base, "refusion_running_rows") == 1)
        wait_for(lambda: metric(base, "refusion_running_rows") == 0)
        cancelled = 'refusion_requests_total{decoder="ar",model="test-model",outcome="cancelled"} 1.0'
        assert cancelled in httpx.get(f"{base}/metrics", verify=False).text.splitlines()
        assert post(base, {"model": "ar", "messages": MESSAGES, "max_tokens": 8}).status_code == 200


def test_a_failing_decode_fails_its_request_only(refusion_tiny, monkeypatch, caplog):
    """Its 500 names a request id, which the log holds with the cause; the body has no exception text."""
    models = served(["ar"])
    spec = decoder_spec("ar")

    def open_row(calls, index, prompt, config, *args):
        program = spec.open_row(calls, index, prompt, config, *args)
        if config.gen_length != 13:
            return program

        def failing():
            yield next(program)
            raise RuntimeError("boom")
        return failing()

    monkeypatch.setitem(registry.DECODERS, "ar", dataclasses.replace(spec, open_row=open_row))
    with running_server(refusion_tiny, models) as (base, _):
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(post, base, {"model": "ar", "messages": MESSAGES, "max_tokens": 13})
            good = pool.submit(post, base, {"model": "ar", "messages": MESSAGES, "max_tokens": 24})
            error = bad.result().json()["error"]
            assert bad.result().status_code == 500 and "boom" not in error["message"]
            request_id = bad.result().headers["x-request-id"]
            assert request_id in error["message"]
            assert any(request_id in record.getMessage() and "boom" in record.getMessage()
                       for record in caplog.records)
            assert good.result().json()["choices"][0]["message"]["content"] == in_process(
                refusion_tiny, models["ar"], QUESTION, 24)[0]


def read_stream(base: str, body: dict, lines: list[str]) -> None:
    """Append each ``data:`` line of a streamed request to ``lines`` as it comes."""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60, verify=False) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)


def fail_engine_step(self) -> None:
    raise RuntimeError("injected: a fault outside the guarded calls")


def test_a_dead_scheduler_fails_every_open_request_and_health_says_503(refusion_tiny):
    with running_server(refusion_tiny, served(["ar"]), max_batch=1) as (base, state):
        streamed: list[str] = []
        reader = threading.Thread(target=read_stream, args=(base, LONG, streamed))
        reader.start()
        wait_for(lambda: len(streamed) > 0)  # running, its answer begun
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, base, {"model": "ar", "messages": MESSAGES, "max_tokens": 8})
            wait_for(lambda: scheduler(state).depth == 1)
            scheduler(state).engine.step = fail_engine_step.__get__(scheduler(state).engine)  # the thread dies
            reader.join(timeout=30)
            assert not reader.is_alive()
            assert waiting.result().status_code == 503
            assert "scheduler stopped" in waiting.result().json()["error"]["message"]
        assert streamed[-1] == "data: [DONE]" and '"error"' in streamed[-2]  # the stream ends with an error event
        health = httpx.get(f"{base}/health", verify=False)
        assert health.status_code == 503 and "RuntimeError" in health.json()["reason"]
        later = post(base, {"model": "ar", "messages": MESSAGES, "max_tokens": 8})
        assert later.status_code == 503 and later.json()["error"]["type"] == "server_error"


DYING_SERVER = """
import sys
from refusion_cli.decoding.engine import Engine
from refusion_cli.cli.app import main
step = Engine.step
def dying_step(self):
    if self.running and self.waiting:  # a request running and one waiting: the thread dies now
        raise RuntimeError("injected")
    step(self)
Engine.step = dying_step
sys.argv = ["refusion", *sys.argv[1:]]
main()
"""


@pytest.mark.slow  # `make test-all` (a serve process of its own); by default the test above fails the open
# requests of a dead scheduler in this process, and tests/serve/test_cli.py ends a serve process with SIGTERM
def test_a_dead_scheduler_makes_the_process_exit_non_zero():
    with serve_process(["-c", DYING_SERVER], "--decoder", "ar", "--model", "refusion-tiny",
                       "--max-batch", "1") as (server, base):
        streamed: list[str] = []
        reader = threading.Thread(target=read_stream, args=(base, LONG, streamed))
        reader.start()
        wait_for(lambda: len(streamed) > 0)
        waiting = post(base, {"model": "ar", "messages": MESSAGES, "max_tokens": 8})
        reader.join(timeout=30)
        assert waiting.status_code == 503 and "scheduler stopped" in waiting.json()["error"]["message"]
        assert '"error"' in streamed[-2] and streamed[-1] == "data: [DONE]"
        assert server.wait(timeout=15) == 1
        assert "error: the scheduler stopped: RuntimeError" in server.stdout.read()
