"""``refusion serve``'s command line: a mistake is one ``error:`` line and exit code 2, before any model loads;
``--model`` as eval, bench and chat read it, and without it each decoder on its own embedded model; SIGTERM
ends the process with exit code 0 once the running request has finished."""

from __future__ import annotations

import signal
import socket
import sys
import threading

import httpx
import pytest

from refusion_cli.cli.app import main
from refusion_cli.cli.serve import memory_shares
from refusion_cli.decoding.memory import ModelSize
from refusion_cli.errors import UserError
from refusion_cli.models.loading import load_model
from tests.serve.helpers import serve_process, wait_for

# the question of the README's serve example: 12 + 7 - 5 + 9
README_QUESTION = ("Mia has 12 apples. She buys 7 more apples. Then she gives 5 apples to Max. Then she finds 9 "
                   "apples. How many apples does Mia have now?")
LONG = {"model": "ar", "prompt": "hello hello hello", "max_tokens": 512, "stream": True}  # a long answer

BAD = [
    (["--decoder", "rnn"], "unknown decoder 'rnn'"),
    (["--model", "refusion-tiny", "--decoder", "llada"], "llada"),  # a causal model: llada does not fit it
    (["--decoder", "ar", "--recheck"], "--recheck"),
    (["--set", "slot_threshold=2"], "slot_threshold"),
    (["--set", "nope=1"], "nope"),
    (["--port", "70000"], "--port"),
    (["--max-batch", "0"], "--max-batch"),
    (["--api-key", " "], "--api-key is empty"),
    (["--max-memory", "lots"], "--max-memory: cannot read 'lots' as a memory size"),
    (["--model", "/no/such/folder"], "/no/such/folder"),
    (["--decoder", "ar", "--model", "ar=mdm-tiny"], "the ar decoder needs a causal model"),
    (["--decoder", "ar", "--model", "ar="], "no checkpoint after '='"),
    (["--decoder", "ar", "--model", "llada=mdm-tiny"], "the llada decoder is not selected"),
    (["--decoder", "ar", "--model", "rnn=ar-tiny"], "'rnn' is not a decoder"),
    (["--decoder", "ar", "--model", "ar-tiny", "--model", "refusion-tiny"], "two checkpoints"),
    (["--decoder", "dream"], "the dream decoder has no embedded model"),
]


def serve(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["refusion", "serve", *args])
    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("args,words", BAD)
def test_a_bad_command_line_is_one_error_line_and_exit_2(capsys, monkeypatch, args, words):
    code, err = serve(capsys, monkeypatch, *args)
    assert code == 2 and err.startswith("error:") and words in err, err
    assert "Traceback" not in err


def test_a_taken_port_is_one_error_line(capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err = serve(capsys, monkeypatch, "--decoder", "ar", "--port", str(taken.getsockname()[1]))
    assert code == 2 and "cannot listen on" in err and "--port" in err, err


def test_model_takes_decoder_equals_checkpoint(capsys, monkeypatch):
    """``--model ar=ar-tiny`` is read, resolved and fit-checked: the first error is the taken port, checked last
    before the models load."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err = serve(capsys, monkeypatch, "--decoder", "refusion", "ar", "--model", "ar=ar-tiny", "--port",
                          str(taken.getsockname()[1]))
    assert code == 2 and "cannot listen on" in err, err


def test_each_decoder_answers_the_readme_question_and_sigterm_lets_the_running_request_finish():
    """One server process, checked two ways: each decoder runs on its embedded model and answers the README's
    question; then SIGTERM during a streamed answer lets it finish, and the process exits 0."""
    with serve_process(["-m", "refusion_cli"], "--decoder", "refusion", "ar") as (server, base):
        cards = httpx.get(f"{base}/v1/models", verify=False).json()["data"]
        assert {card["id"]: card["checkpoint"] for card in cards} == {"refusion": "refusion-tiny", "ar": "ar-tiny"}
        for model in ("refusion", "ar"):
            reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": [{"role": "user", "content": README_QUESTION}]}, verify=False).json()
            assert reply["choices"][0]["message"]["content"].endswith("#### 23"), (model, reply)
        chunks: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json=LONG, timeout=60, verify=False) as response:
                chunks.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: len(chunks) > 0)
        server.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert server.wait(timeout=60) == 0
        assert chunks[-1] == "data: [DONE]" and '"finish_reason": "' in chunks[-2]  # it finished, not cut


def test_max_memory_gives_each_checkpoint_its_weights_and_an_even_share():
    models = {name: load_model(name, "cpu") for name in ("ar-tiny", "mdm-tiny")}
    weights = {name: ModelSize.of(loaded.model).weights for name, loaded in models.items()}
    total = sum(weights.values()) + 2 * 2**20
    assert memory_shares(models, total) == {name: weights[name] + 2**20 for name in models}
    assert memory_shares({"ar-tiny": models["ar-tiny"]}, total) == {"ar-tiny": total}
    with pytest.raises(UserError, match="does not hold the weights"):
        memory_shares(models, sum(weights.values()))
