"""A memory budget on the LLaDA stand-in (its real 126,464-word vocabulary, so that a row's logits and sampler
are what its memory is): eval's ``batch_size=auto``, bench's ``--batch-size auto`` and serve's ``--max-memory``
run the rows the memory model fits, and in eval the weights plus the measured peak of decoding (the resident
set above the loaded process's) stay under the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from refusion_cli.bench.prompts import load_prompts
from refusion_cli.decoding.memory import ModelSize
from refusion_cli.decoding.registry import build_config, row_memory_bytes, with_length
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from tests.bench.helpers import read_csv, run_bench_cli
from tests.serve.helpers import running_server, served

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from lm_eval.api.instance import Instance
from tools.logits_memory import memory_kib, reset_peak
from refusion_cli.decoding.memory import ModelSize, fitting_batch, parse_memory
from refusion_cli.decoding.registry import build_config, row_memory_bytes
from refusion_cli.harness.lm_adapters import ADAPTERS

standin, budget = sys.argv[1], sys.argv[2]
prompts = [f"Question {i}: how many legs have {i} spiders and {i + 1} ants together?" for i in range(6)]
requests = [Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 32}), i)
            for i, text in enumerate(prompts)]
lm = ADAPTERS["llada"](pretrained=standin, device="cpu", dtype="bfloat16", batch_size="auto", max_memory=budget,
                       warmed_up=True, gen_length=32, steps=32, block_length=32)
size = ModelSize.of(lm.model)
loaded = memory_kib("VmRSS")  # the weights, and the tokenizer and libraries the load brought in (not budgeted)
reset_peak()
answers = lm.generate_until(requests)
peak = size.weights + (memory_kib("VmHWM") - loaded) * 1024  # the weights and everything the decode held at once
config = build_config("llada", {"gen_length": 32, "steps": 32, "block_length": 32})
row = max(row_memory_bytes("llada", config, len(lm.tok_encode(text)), size) for text in prompts)
predicted = fitting_batch(parse_memory(budget), size.weights, row, len(prompts), "--max-memory").size
print(json.dumps({"rows": sorted({s.batch_rows for s in lm.samples}), "predicted": predicted, "peak": peak,
                  "row": row, "weights": size.weights, "notes": lm.batch_notes, "answers": len(answers)}))
"""


@pytest.mark.slow  # `make test-all` (~50 s of bfloat16 decoding): eval's memory admission is also checked by
# tests/harness/test_batch_halving.py; the measured peak under the budget only here
def test_batch_size_auto_picks_the_predicted_batch_and_its_peak_stays_under_the_budget(standin, tmp_path):
    model = standin("llada-8b-instruct")
    budget_mib = 64 + 8 + 3.5 * 47  # the reserve, the stand-in's weights and 3.5 rows of ~47 MiB: batch 3
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), f"{budget_mib:.0f}MiB"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["predicted"] == 3 and found["rows"] == [3] and found["answers"] == 6  # 3 rows at most at once
    assert found["notes"][0].startswith("batch size auto: 3 (")
    assert found["peak"] <= round(budget_mib) * 2**20, found  # the weights and two batches decoded


@pytest.mark.slow  # `make test-all` (~45 s): the same admission rule runs by default through serve, below
def test_bench_batch_size_auto_runs_the_rows_the_budget_fits(standin, monkeypatch, capsys, tmp_path):
    """``refusion bench --batch-size auto --max-memory`` on the LLaDA stand-in: the engine admits the rows the
    memory model fits (three here) and no more, and decodes every prompt once (its text is batch 1's up to
    float rounding: bfloat16 on random weights holds near-ties, so the texts are not compared here)."""
    model = standin("llada-8b-instruct")
    loaded = load_model(str(model), device="cpu", dtype="bfloat16")
    prompts = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in load_prompts(limit=4)]
    config = build_config("llada", with_length("llada", {"gen_length": 32}))
    size = ModelSize.of(loaded.model)
    row = max(row_memory_bytes("llada", config, len(prompt), size) for prompt in prompts)
    budget = 64 * 2**20 + size.weights + int(3.5 * row)  # the reserve, the weights and 3.5 rows: 3 rows fit
    code, _, err = run_bench_cli(["--decoder", "llada", "--model", str(model), "--gen-length", "32", "--limit", "4",
                                  "--batch-size", "1,auto", "--max-memory", str(budget), "--dtype", "bfloat16",
                                  "--device", "cpu", "--warmup", "0", "--output", str(tmp_path)], monkeypatch, capsys)
    assert code == 0, err
    rows = {row["decoder"]: row for row in read_csv(tmp_path / "bench.csv")}
    assert rows["llada (batch auto)"]["batch_size"] == "3"
    samples = read_csv(tmp_path / "samples.csv")
    counts = {(s["decoder"], s["prompt"]): (s["tokens"], s["forwards"]) for s in samples}
    assert sorted(counts) == sorted((decoder, str(i)) for decoder in ("llada", "llada (batch auto)") for i in range(4))
    assert all(counts["llada (batch auto)", str(i)] == counts["llada", str(i)] for i in range(4))


def test_serve_max_memory_runs_the_rows_the_budget_fits(standin):
    """``refusion serve --max-memory`` on the LLaDA stand-in: six concurrent requests, a budget of 3.5 rows by
    the memory model, and the engine runs three rows at once, not more (in float32, which this CPU decodes about
    twice as fast: the budget follows the dtype through ``ModelSize``; the bfloat16 runs are the slow tests')."""
    model = standin("llada-8b-instruct")
    loaded = load_model(str(model), device="cpu", dtype="float32")
    questions = [prompt.text for prompt in load_prompts(limit=6)]
    config = build_config("llada", with_length("llada", {"gen_length": 16}))
    size = ModelSize.of(loaded.model)
    row = max(row_memory_bytes("llada", config, len(user_prompt_ids(loaded.tokenizer, q)), size) for q in questions)
    budget = 64 * 2**20 + size.weights + int(3.5 * row)
    body = lambda question: {"model": "llada", "max_tokens": 16,  # noqa: E731
                             "messages": [{"role": "user", "content": question}]}
    with running_server(loaded, served(["llada"]), max_batch=16, max_memory=budget) as (base, state):
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda q: httpx.post(f"{base}/v1/chat/completions", json=body(q), timeout=300,
                                                         verify=False), questions))
        assert state.schedulers["test-model"].engine.counts.peak_rows == 3
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
