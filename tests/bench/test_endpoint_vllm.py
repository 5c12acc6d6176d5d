"""vLLM as the AR baseline: its greedy answers on ar-tiny, loaded by `refusion bench --endpoint`, are the `ar`
decoder's in process. Opt-in (marked slow; about a minute): needs vLLM's venv, build/vllm-venv (docs/served.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bench.helpers import read_csv, run_bench_cli
from tests.ports import free_port
from tools.serve_load import launch
from tools.served_compare import VLLM_ENV, VLLM_NAME, vllm_command

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / "build" / "vllm-venv" / "bin" / "python"
PROMPTS = 20

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv in build/vllm-venv (docs/served.md)")]


def test_vllm_greedy_answers_are_the_ar_decoders(monkeypatch, capsys, tmp_path):
    port = free_port()
    env = {**os.environ, **VLLM_ENV, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    server = launch(vllm_command(VLLM_PYTHON, str(REPO / "refusion_cli" / "assets" / "ar-tiny"), port), env,
                    f"http://127.0.0.1:{port}", tmp_path / "vllm.log")
    try:
        code, _, err = run_bench_cli([f"--endpoint=http://127.0.0.1:{port}={VLLM_NAME}", "--concurrency=1",
                                      f"--limit={PROMPTS}", "--gen-length=128", "--output", str(tmp_path / "vllm")],
                                     monkeypatch, capsys)
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert code == 0, err
    code, _, err = run_bench_cli(["--decoder=ar", f"--limit={PROMPTS}", "--gen-length=128", "--output",
                                  str(tmp_path / "ar")], monkeypatch, capsys)
    assert code == 0, err
    ours = {sample["prompt"]: sample["output"] for sample in read_csv(tmp_path / "ar" / "samples.csv")}
    theirs = {sample["prompt"]: sample["output"] for sample in read_csv(tmp_path / "vllm" / "served_samples.csv")}
    same = sum(ours[prompt] == text for prompt, text in theirs.items())
    assert len(theirs) == PROMPTS and same >= 0.95 * PROMPTS, (same, PROMPTS)
