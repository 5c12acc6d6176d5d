"""One thread calls each tokenizer: under concurrent requests (chat and completions, streamed and not, stop
strings, ``n``, ``/tokenize``) the model's tokenizer is called from the tokenizer thread only and the stop
rules' copy from the scheduler thread only; the answers are those of the requests one at a time."""

from __future__ import annotations

import copy
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from refusion_cli.models.loading import load_model
from tests.serve.helpers import CHECKPOINT, ask, running_server, served

QUESTIONS = ["Tom has 3 apples and buys 4 more. How many apples does he have?", "hello hello hello"]


class ThreadsSeen:
    """A tokenizer that notes the name of every thread that reads or calls it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.threads.add(threading.current_thread().name)
        value = getattr(self.tokenizer, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            return value(*args, **kwargs)
        return call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return self.tokenizer(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> ThreadsSeen:
        return ThreadsSeen(copy.deepcopy(self.tokenizer, memo))


def requests() -> list[tuple[dict, bool, bool]]:
    """(body, chat, stream) of each request: every question, chat and completions, streamed and not."""
    asked = []
    for question in QUESTIONS:
        for chat in (True, False):
            where = {"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question}
            body = {"model": "ar", "max_tokens": 16, "stop": [" is", "\n#"], "n": 2, **where}
            asked += [(body, chat, False), (body, chat, True)]
    return asked


def test_each_tokenizer_is_called_from_one_thread_under_concurrency():
    loaded = load_model("ar-tiny", "cpu")
    watched = dataclasses.replace(loaded, tokenizer=ThreadsSeen(loaded.tokenizer))
    with running_server(watched, served(["ar", "refusion"])) as (base, state):
        alone = [ask(base, body, chat=chat, stream=stream).texts for body, chat, stream in requests()]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda asked: ask(base, asked[0], chat=asked[1], stream=asked[2]).texts,
                                     requests()))
            tokenized = pool.submit(httpx.post, f"{base}/tokenize", json={"prompt": QUESTIONS[0]}, verify=False)
        assert tokenized.result().status_code == 200
        stop_tokenizer = state.stop_tokenizers[CHECKPOINT]
    assert together == alone
    assert watched.tokenizer.threads == {"refusion-tokenizer_0"}
    assert stop_tokenizer.threads == {"refusion-scheduler"}
