"""Two ``refusion serve`` replicas behind Debian's nginx (docs/serve.md's configuration): 32 concurrent requests,
one replica killed mid-run. Every request whose answer had not begun completes on the other replica with its
batch-1 answer (nginx's ``proxy_next_upstream``; a streamed answer begins with the first decoder step), one in
flight on the killed replica ends with an error, none hangs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from refusion_cli.harness.suite import EVALS_DIR
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import read_jsonl
from tests.ports import free_port
from tests.serve.helpers import in_process, served, wait_for

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [problem["question"] for problem in read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[:32]]
MAX_TOKENS = 64

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NGINX is None, reason="nginx is not installed")]


def nginx_config(folder: Path, listen: int, replicas: list[int]) -> str:
    """docs/serve.md's configuration, with every path in ``folder`` (a non-daemon nginx of this user)."""
    servers = "\n".join(f"        server 127.0.0.1:{port} max_fails=1 fail_timeout=10s;" for port in replicas)
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log {folder}/access.log;
    client_body_temp_path {folder}/client_body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream refusion {{
        least_conn;
{servers}
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{listen};
        location / {{
            proxy_pass http://refusion;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 2;
            add_header X-Upstream $upstream_addr always;
        }}
    }}
}}
"""


@dataclass
class Answer:
    upstream: str = ""
    chunks: int = 0  # content chunks read
    text: str = ""
    done: bool = False  # [DONE] read
    error: str | None = None
    began: threading.Event = field(default_factory=threading.Event)


def ask(base: str, question: str, answer: Answer) -> None:
    body = {"model": "ar", "max_tokens": MAX_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": question}]}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120, verify=False) as response:
            answer.upstream = response.headers.get("x-upstream", "")
            if response.status_code != 200:
                answer.error = f"{response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    answer.done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = chunk["error"]["message"]
                    continue
                answer.chunks += 1
                answer.began.set()
                answer.text += chunk["choices"][0]["delta"].get("content") or ""
        if not answer.done and answer.error is None:
            answer.error = "the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"


def start_replica(port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "refusion_cli", "serve", "--model", "refusion-tiny", "--decoder",
                             "ar", "--port", str(port), "--max-batch", "4"], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5, verify=False).status_code == 200
    except httpx.TransportError:
        return False


def test_two_replicas_behind_nginx_survive_a_killed_one(tmp_path):
    ports = [free_port(), free_port()]
    listen = free_port()
    replicas = [start_replica(port, tmp_path / f"replica-{port}.log") for port in ports]
    (tmp_path / "nginx.conf").write_text(nginx_config(tmp_path, listen, ports))
    proxy = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e",
                              str(tmp_path / "error.log")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{listen}"
    try:
        loaded = load_model("refusion-tiny", "cpu")
        entry = served(["ar"])["ar"]
        expected = [in_process(loaded, entry, question, MAX_TOKENS)[0] for question in QUESTIONS]
        for port in ports:
            wait_for(lambda port=port: healthy(f"http://127.0.0.1:{port}/health"), timeout=120)
        wait_for(lambda: healthy(f"{base}/health"), timeout=30)
        answers = [Answer() for _ in QUESTIONS]
        threads = [threading.Thread(target=ask, args=(base, question, answer))
                   for question, answer in zip(QUESTIONS, answers)]
        for thread in threads:
            thread.start()
        killed = f"127.0.0.1:{ports[0]}"
        wait_for(lambda: any(a.began.is_set() and a.upstream == killed for a in answers), timeout=60)
        replicas[0].send_signal(signal.SIGKILL)  # mid-run: answers streaming, requests waiting for a row
        deadline = time.monotonic() + 120
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in threads), "a request hangs"
        failed = [a for a in answers if a.error is not None]
        for question, answer, text in zip(QUESTIONS, answers, expected):
            if answer.error is None:
                assert answer.text == text, (question, answer.upstream)  # its batch-1 answer, on either replica
            else:  # only an answer already begun on the killed replica (its status line from there) may fail
                assert answer.upstream == killed, (answer.upstream, answer.chunks, answer.error)
        assert failed, "the killed replica had an answer in flight"
        retried = [a for a in answers if a.error is None and a.upstream.startswith(killed + ",")]
        assert retried, "requests waiting on the killed replica were sent to the other"
        assert all(a.upstream.endswith(f"127.0.0.1:{ports[1]}") for a in retried)
    finally:  # SIGTERM: nginx's master stops its workers before it exits (a SIGKILL would orphan them)
        for process in (proxy, *replicas):
            if process.poll() is None:
                process.terminate()
        for process in (proxy, *replicas):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
