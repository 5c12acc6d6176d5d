"""lm-eval through the server: ``local-chat-completions`` against ``refusion serve`` on the synthetic task gives,
answer for answer, what ``refusion eval --task synthetic`` gives in process."""

from __future__ import annotations

import json

import lm_eval
import lm_eval.models.openai_completions  # noqa: F401  (registers local-chat-completions)
from lm_eval.tasks import TaskManager

from refusion_cli.decoding.spec import DecoderChoice
from refusion_cli.harness.runner import EvalOptions, run_eval
from refusion_cli.harness.suite import load_suite, render
from refusion_cli.models.loading import load_model
from refusion_cli.serve.protocol import ServedModel
from tests.serve.helpers import CHECKPOINT, running_server

LIMIT = 6


def test_lm_eval_through_the_server_gives_the_in_process_answers(tmp_path):
    run_dir = tmp_path / "run"
    run_eval(EvalOptions(tasks=["synthetic"], decoders=["refusion"], output=run_dir, limit=LIMIT, device="cpu"))
    [journal] = (run_dir / "samples" / "synthetic").glob("refusion__*.jsonl")
    in_process = {record["doc_id"]: record["output"]
                  for record in map(json.loads, journal.read_text(encoding="utf-8").splitlines())}

    benchmark = load_suite().benchmarks["synthetic"]
    rendered = render(benchmark, tmp_path / "tasks")
    rendered.write(tmp_path / "tasks")
    loaded = load_model("refusion-tiny", "cpu")
    entry = ServedModel("refusion", DecoderChoice("refusion", CHECKPOINT, benchmark.preset, {}))  # the suite's preset
    with running_server(loaded, {"refusion": entry}) as (base, _):
        results = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args=f"base_url={base}/v1/chat/completions,model=refusion,num_concurrent=3,max_retries=1,"
                       "tokenized_requests=False",
            tasks=["synthetic"], task_manager=TaskManager(include_path=[str(tmp_path / "tasks")],
                                                         include_defaults=False),
            apply_chat_template=True, limit=LIMIT, log_samples=True)
    served = {sample["doc_id"]: sample["resps"][0][0] for sample in results["samples"]["synthetic"]}
    assert len(served) == LIMIT
    assert served == in_process
