"""`refusion bench --endpoint`: against `refusion serve` (its app, in this process) it gives the in-process bench's
answers and token counts; bad input (an unreachable endpoint, a wrong model name, a server that is not OpenAI's or
that fails mid-run) is one line and exit 2, with the levels measured before written. A scripted stand-in server
plays the bad ones."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from refusion_cli.bench.endpoint import parse_endpoint
from refusion_cli.bench.served import AR, DLLM, Crossover, ServedRow, crossovers, row_kind
from refusion_cli.errors import UserError
from refusion_cli.models.loading import load_model
from tests.bench.helpers import error_line, read_csv, run_bench_cli
from tests.ports import free_port
from tests.serve.helpers import running_server, served

LIMIT, LENGTH = 3, 32


@pytest.fixture(scope="module")
def refusion_server() -> Iterator[str]:
    """``refusion serve --decoder=refusion --max-batch=4`` on refusion-tiny, in this process (tests/serve/test_cli.py
    starts the command as a process of its own)."""
    checkpoint = "refusion-tiny"
    with running_server({checkpoint: load_model(checkpoint, "cpu")}, served(["refusion"], checkpoint=checkpoint),
                        max_batch=4) as (base, _):
        yield base


def test_served_answers_and_token_counts_are_the_in_process_bench_ones(refusion_server, monkeypatch, capsys,
                                                                     tmp_path):
    common = ["--limit", str(LIMIT), f"--gen-length={LENGTH}"]
    code, _, err = run_bench_cli(["--decoder=refusion", "--no-ablation", *common, "--output", str(tmp_path / "in")],
                                 monkeypatch, capsys)
    assert code == 0, err
    code, out, err = run_bench_cli([f"--endpoint={refusion_server}=refusion", "--concurrency=1,2", *common,
                                    "--output", str(tmp_path / "served")], monkeypatch, capsys)
    assert code == 0, err
    expected = {int(s["prompt"]): (s["output"], s["tokens"]) for s in read_csv(tmp_path / "in" / "samples.csv")}
    samples = read_csv(tmp_path / "served" / "served_samples.csv")
    assert len(samples) == 2 * LIMIT  # every prompt once at each level
    for sample in samples:
        assert (sample["output"], sample["tokens"]) == expected[int(sample["prompt"])], sample
    rows = read_csv(tmp_path / "served" / "served.csv")
    assert [(row["endpoint"], row["kind"], row["concurrency"]) for row in rows] == [("refusion", DLLM, "1"),
                                                                                   ("refusion", DLLM, "2")]
    in_process = read_csv(tmp_path / "in" / "bench.csv")[0]
    assert all(row["accuracy"] == in_process["accuracy"] for row in rows)
    assert all(float(row["throughput"]) > 0 and float(row["ttft_p50_ms"]) > 0 for row in rows)
    for name in ("served.md", "served.png"):
        assert (tmp_path / "served" / name).is_file()
    assert "refusion (dLLM), concurrency 2:" in out


# --- a scripted stand-in server ---------------------------------------------------------------


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


STREAM = [chunk({"role": "assistant", "content": ""}), chunk({"content": "So 2 + 3 = 5.\n"}),
          chunk({"content": "#### 5"}, "stop"), {"choices": [], "usage": {"completion_tokens": 9}}]


@contextmanager
def stand_in(models: list[str], *, html: bool = False, cut_after: int | None = None) -> Iterator[str]:
    """A server on 127.0.0.1 serving ``models``: a short streamed answer to every chat request, the ``cut_after``-th
    and later ones cut before ``[DONE]``; ``html``: a web page for every request."""
    served = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def reply(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except ConnectionError:  # the client gave up on this request after another one failed
                pass

        def do_GET(self) -> None:
            if html:
                return self.reply(b"<html><body>hello</body></html>", "text/html")
            self.reply(json.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in models]}).encode(),
                       "application/json")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if html:
                return self.reply(b"<html><body>hello</body></html>", "text/html")
            with lock:
                served[0] += 1
                cut = cut_after is not None and served[0] > cut_after
            events = [f"data: {json.dumps(event)}\n\n" for event in STREAM] + ([] if cut else ["data: [DONE]\n\n"])
            self.reply("".join(events[:2] if cut else events).encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def served_bench(args: list[str], monkeypatch, capsys, output: Path) -> tuple[int, str]:
    code, _, err = run_bench_cli([*args, "--limit=2", "--output", str(output)], monkeypatch, capsys)
    return code, err


def test_a_stand_in_server_is_loaded_and_scored(monkeypatch, capsys, tmp_path):
    with stand_in(["ar"]) as base:
        code, err = served_bench([f"--endpoint={base}/v1", "--concurrency=1,2", "--max-requests=3"], monkeypatch,
                                 capsys, tmp_path)
    assert code == 0, err
    rows = read_csv(tmp_path / "served.csv")
    assert [(row["endpoint"], row["kind"], row["requests"], row["tokens"]) for row in rows] == [
        ("ar", AR, "3", "27"), ("ar", AR, "3", "27")]  # the one model it serves; 9 tokens each, from the usage
    samples = read_csv(tmp_path / "served_samples.csv")
    assert [sample["prompt"] for sample in samples[:3]] == ["0", "1", "0"]  # request i asks prompt i mod 2
    assert samples[0]["output"] == "So 2 + 3 = 5.\n#### 5"


def test_an_unreachable_endpoint_is_one_line(monkeypatch, capsys, tmp_path):
    code, err = served_bench([f"--endpoint=http://127.0.0.1:{free_port()}"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "cannot reach the endpoint" in error_line(err)
    assert not tmp_path.joinpath("served.csv").exists()


def test_a_wrong_model_name_is_one_line(monkeypatch, capsys, tmp_path):
    with stand_in(["ar"]) as base:
        code, err = served_bench([f"--endpoint={base}=refusion"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "serves no model 'refusion'; it serves ar" in error_line(err)


def test_a_server_that_is_not_openai_compatible_is_one_line(monkeypatch, capsys, tmp_path):
    with stand_in([], html=True) as base:
        code, err = served_bench([f"--endpoint={base}=ar"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "is not an OpenAI-compatible server" in error_line(err)


def test_a_server_failing_mid_run_is_one_line_and_the_levels_measured_are_written(monkeypatch, capsys, tmp_path):
    with stand_in(["ar"], cut_after=3) as base:  # the warm-up and the first level's two answer, then cut
        code, err = served_bench([f"--endpoint={base}=ar", "--concurrency=1,2"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "concurrency 2: the stream ended before 'data: [DONE]'" in error_line(err)
    assert [row["concurrency"] for row in read_csv(tmp_path / "served.csv")] == ["1"]
    assert "**Interrupted:**" in (tmp_path / "served.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--endpoint=ftp://127.0.0.1:1"], "is not an http(s) URL"),
    (["--endpoint=http://127.0.0.1:1=", ], "names no model after '='"),
    (["--endpoint=http://127.0.0.1:1", "--concurrency=0"], "--concurrency must be whole numbers >= 1"),
    (["--endpoint=http://127.0.0.1:1", "--decoder=ar"], "--decoder does not apply with --endpoint"),
    (["--concurrency=4"], "--concurrency needs --endpoint"),
])
def test_bad_options_are_one_line(args, message, monkeypatch, capsys, tmp_path):
    code, err = served_bench(args, monkeypatch, capsys, tmp_path)
    assert code == 2 and message in error_line(err)


# --- parts ------------------------------------------------------------------------------------


def test_an_endpoint_url_loses_its_route_tail():
    assert parse_endpoint("http://h:8000/v1/chat/completions=ar").base == "http://h:8000"
    assert parse_endpoint("http://h/proxy/v1/").base == "http://h/proxy"
    assert parse_endpoint("https://h:1").model is None
    with pytest.raises(UserError):
        parse_endpoint("h:8000")


def test_diffusion_decoders_and_their_variants_are_dllm_rows_the_rest_ar():
    assert [row_kind(name) for name in ("refusion", "refusion-recheck", "llada-fast-dllm", "ar", "vllm-ar",
                                        "Qwen/Qwen3-8B")] == [DLLM, DLLM, DLLM, AR, AR, AR]


def row(label: str, kind: str, concurrency: int, throughput: float) -> ServedRow:
    return ServedRow(label, kind, "", concurrency, 1, 1.0, 1, throughput, 1.0, 1.0, *[1.0] * 8, None, 0, False)


def test_the_crossover_is_the_highest_level_where_the_dllm_is_still_ahead():
    rows = [row("refusion", DLLM, c, t) for c, t in ((1, 300), (4, 500), (16, 600), (64, 600))]
    rows += [row("ar", AR, c, t) for c, t in ((1, 100), (4, 400), (16, 900), (64, 2000))]
    (found,) = crossovers(rows)
    assert found == Crossover("refusion", "ar", {1: 3.0, 4: 1.25, 16: 600 / 900, 64: 0.3})
    assert found.highest == 4 and found.line().startswith("refusion above ar up to concurrency 4 (3.00× at 1")
    assert Crossover("refusion", "ar", {1: 0.5}).highest is None
