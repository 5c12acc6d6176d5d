"""Every command on each of the four checkpoints' stand-ins, offline: chat, bench --tps at batch 1 and 2,
eval (synthetic and HumanEval) and lm-eval through model_args; and lm-eval's model_args take the length
rules refusion eval takes.

Commands run in-process through the real entry point (``refusion_cli.cli.app.main``), with tiny
response lengths: the stand-ins are random, so what is checked is that each command runs to its end
on these layouts and writes what it promises, not the answers.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from refusion_cli.decoding.spec import DecoderChoice
from refusion_cli.harness.lm_adapters import ADAPTERS
from tests.standins.helpers import run

REPO = Path(__file__).resolve().parents[2]
GEN_LENGTH = 8
# stand-in -> (decoder, its --set values: Dream greedy without top-p, whose sort over 152k ids is slow on a CPU)
RUNS = {
    "refusion": ("refusion", ["slot_size=4", "block_size=8"]),
    "qwen3-8b": ("ar", []),
    "llada-8b-instruct": ("llada", []),
    "dream-v0-instruct-7b": ("dream", ["temperature=0", "top_p=1"]),
    "llama-3-8b-instruct": ("ar", []),
}
LM_EVAL_TASK = """task: standin_synthetic
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {length}
  do_sample: false
metric_list:
  - metric: exact_match
num_fewshot: 0
"""


def options(name: str, directory: Path) -> list[str]:
    decoder, sets = RUNS[name]
    return ["--decoder", decoder, "--model", str(directory), "--device", "cpu",
            *[item for value in sets for item in ("--set", value)]]


def split(default: set[str]) -> list:
    """The stand-ins, those outside ``default`` marked slow (``make test-all``). By default each command runs on one
    stand-in of each kind between them: chat on ReFusion's, bench on Dream's, eval on ReFusion's and LLaDA's,
    lm-eval on ReFusion's and Dream's; the Llama 3 stand-in (the AR decoder, as Qwen3-8B's) runs eval in its
    Table 1 test, and tests/standins/test_native_loading.py loads and decodes every stand-in."""
    return [name if name in default else pytest.param(name, marks=pytest.mark.slow) for name in sorted(RUNS)]


@pytest.mark.parametrize("name", split({"refusion"}))
def test_chat_answers_on_each_stand_in(standin, name, monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, "chat", *options(name, standin(name)), "--set",
                         f"gen_length={GEN_LENGTH}", "--prompt", "What is 12 + 7?")
    assert code == 0, err
    assert out.strip() and "tokens/forward" in out + err  # the answer, then its counts


@pytest.mark.parametrize("name", split({"dream-v0-instruct-7b"}))
def test_bench_times_batch_1_and_2_on_each_stand_in(standin, name, monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, "bench", "--tps", *options(name, standin(name)), "--gen-length",
                       str(GEN_LENGTH), "--limit", "2", "--batch-size", "1,2", "--repeats", "1", "--warmup", "0",
                       "--output", str(tmp_path / "bench"))
    assert code == 0, err
    with (tmp_path / "bench" / "bench.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {int(row["batch_size"]) for row in rows} == {1, 2}


@pytest.mark.parametrize("name", split({"refusion", "llada-8b-instruct"}))  # Llama 3: its Table 1 test below
def test_eval_runs_synthetic_and_humaneval_on_each_stand_in(standin, name, monkeypatch, capsys, tmp_path):
    output = tmp_path / "eval"
    code, _, err = run(monkeypatch, capsys, "eval", "--task", "synthetic", "humaneval", *options(name, standin(name)),
                       "--set", f"gen_length={GEN_LENGTH}", "--limit", "1", "--confirm-run-unsafe-code",
                       "--output", str(output))
    assert code == 0, err
    for task in ("synthetic", "humaneval"):
        (samples,) = (output / "samples" / task).glob("*.jsonl")
        assert len(samples.read_text().splitlines()) == 1
    cells = {cell["benchmark"]: cell for cell in json.loads((output / "metrics.json").read_text())["results"]}
    assert cells["synthetic"]["sandbox"] == {}  # no code ran
    sandbox = cells["humaneval"]["sandbox"]  # how the candidate ran, beside its score
    assert sandbox["user"] in ("throwaway", "evaluator") and sandbox["packages"] is True
    assert Path(sandbox["interpreter"]).exists()


def test_a_llama_3_run_stands_beside_the_papers_llama_3_row(standin, monkeypatch, capsys, tmp_path):
    """A model folder named as the checkpoint is matched to its Table 1 row (ar: Llama-3-8B-Instruct, not Qwen3-8B),
    and the paper protocol ends its responses at <|eot_id|>, the tokenizer's EOS."""
    import shutil

    from refusion_cli.harness.manifest import hub_name, table1

    [llama] = [row for row in table1()[1] if row.name == "Llama-3-8B-Instruct"]  # its numbers: the registry's
    model = Path(shutil.copytree(standin("llama-3-8b-instruct"), tmp_path / hub_name(llama.checkpoint)))
    output = tmp_path / "eval"
    code, _, err = run(monkeypatch, capsys, "eval", "--task", "humaneval", "--decoder", "ar", "--model", str(model),
                       "--device", "cpu", "--set", f"gen_length={GEN_LENGTH}", "--limit", "1",
                       "--confirm-run-unsafe-code", "--output", str(output))
    assert code == 0, err
    summary = (output / "summary.md").read_text(encoding="utf-8")
    [line] = [line for line in summary.splitlines() if line.startswith(f"| {llama.name} |")]
    mmlu_pro, humaneval = llama.cells["mmlu_pro"], llama.cells["humaneval"]
    assert line.startswith(f"| {llama.name} | ar:{hub_name(llama.checkpoint)} | - ({mmlu_pro[0]:.2f}) / "
                           f"- ({mmlu_pro[1]:.2f}) |")
    assert f"({humaneval[0]:.2f}, " in line  # its HumanEval cell beside the paper's


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory) -> Path:
    """A local lm-eval task over the synthetic test split, answered in GEN_LENGTH tokens."""
    tasks = tmp_path_factory.mktemp("tasks")
    (tasks / "standin_synthetic.yaml").write_text(LM_EVAL_TASK.format(
        data=REPO / "evals" / "synthetic" / "test.jsonl", length=GEN_LENGTH))
    return tasks


@pytest.fixture(scope="module")
def task_manager(task_folder):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_folder), include_defaults=False)  # this task alone


@pytest.mark.slow  # `make test-all` (13 s: lm-eval's command line indexes its task files first); by default
# tests/harness/test_adapters.py checks the same merge of model_args and the command line's keys
def test_refusion_lm_eval_takes_device_from_model_args(standin, task_folder, monkeypatch, capsys, tmp_path):
    """lm-eval's command line passes its own default device (cuda:0) when --device is absent: device= in
    model_args wins over it instead of clashing ("given twice")."""
    name = "llada-8b-instruct"
    code, _, err = run(monkeypatch, capsys, "lm-eval", "run", "--model", "llada", "--model_args",
                       f"pretrained={standin(name)},device=cpu", "--tasks", "standin_synthetic", "--include_path",
                       str(task_folder), "--limit", "1", "--apply_chat_template", "--output_path",
                       str(tmp_path / "out"))
    assert code in (0, None), err
    (results,) = (tmp_path / "out").rglob("results_*.json")
    assert "standin_synthetic" in json.loads(results.read_text())["results"]


@pytest.mark.parametrize("name", split({"refusion", "dream-v0-instruct-7b"}))
def test_lm_eval_runs_through_model_args_on_each_stand_in(standin, name, task_manager):
    import refusion_cli.harness.lm_adapters  # noqa: F401  (registers the adapters)
    from lm_eval.evaluator import simple_evaluate

    decoder, sets = RUNS[name]
    results = simple_evaluate(model=decoder, model_args=",".join([f"pretrained={standin(name)}", "device=cpu", *sets]),
                              tasks=["standin_synthetic"], task_manager=task_manager, limit=1,
                              apply_chat_template=True, device="cuda:0", log_samples=True)  # the CLI's default
    (sample,) = results["samples"]["standin_synthetic"]
    assert isinstance(sample["resps"][0][0], str)
    assert "exact_match,none" in results["results"]["standin_synthetic"]


@pytest.fixture(scope="module")
def adapter_of(standin):
    """``adapter_of(name, model_args)``: the lm-eval adapter of stand-in ``name`` from ``pretrained=<its folder>,``
    and ``model_args``, made (its model loaded) once per module; ``prepare`` only reads it."""
    made = {}

    def get(name: str, model_args: str):
        if (name, model_args) not in made:
            made[name, model_args] = ADAPTERS[RUNS[name][0]].create_from_arg_string(
                f"pretrained={standin(name)},{model_args}")
        return made[name, model_args]

    return get


@pytest.mark.parametrize("name", ["llada-8b-instruct", "dream-v0-instruct-7b"])
@pytest.mark.parametrize("max_gen_toks", [192, 512])
def test_model_args_follow_the_length_rules_of_refusion_eval(standin, adapter_of, name, max_gen_toks):
    """The same task through refusion eval (DecoderChoice.config) and through lm-eval's model_args decodes
    with the same steps and blocks: steps follow the response length, LLaDA's blocks of 32."""
    decoder = RUNS[name][0]
    adapter = adapter_of(name, "device=cpu")
    prepared = adapter.prepare("What is 12 + 7?", {"max_gen_toks": max_gen_toks, "until": []})
    assert prepared.config == DecoderChoice(decoder, str(standin(name))).config(max_gen_toks)
    assert prepared.config.steps == max_gen_toks
    if decoder == "llada":
        assert prepared.config.block_length == 32
    # settings given in model_args stay as given
    fixed = adapter_of(name, "steps=64,gen_length=64")
    assert fixed.prepare("Q", {"max_gen_toks": 128}).config.steps == 64


MYSTERY_CONFIG = '''from transformers import PretrainedConfig


class MysteryConfig(PretrainedConfig):
    model_type = "mystery"
'''
MYSTERY_MODEL = '''from transformers import PreTrainedModel

from .configuration_mystery import MysteryConfig


class MysteryLM(PreTrainedModel):
    config_class = MysteryConfig

    def __init__(self, config):
        raise AttributeError("'MysteryLM' object has no attribute 'all_tied_weights_keys'")
'''


def test_a_checkpoint_whose_own_code_fails_to_load_is_one_error_line(causal_checkpoint, monkeypatch, capsys,
                                                                       tmp_path):
    """Remote code written for another transformers release (as LLaDA's and Dream's were) fails in its own
    way; the command says so in one line, with a hint, and exits 2."""
    import shutil

    directory = Path(shutil.copytree(causal_checkpoint, tmp_path / "mystery"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "mystery", "architectures": ["MysteryLM"],
        "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig",
                     "AutoModelForCausalLM": "modeling_mystery.MysteryLM"}}))
    (directory / "configuration_mystery.py").write_text(MYSTERY_CONFIG)
    (directory / "modeling_mystery.py").write_text(MYSTERY_MODEL)
    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    # remote code counts as a masked-diffusion model: the decoder that fits it, so that the fit check (before any
    # weights load) passes and the load itself fails
    code, out, err = run(monkeypatch, capsys, "chat", "--decoder", "llada", "--model", str(directory), "--device",
                         "cpu", "--trust-remote-code", "--prompt", "hi")
    assert code == 2 and out == "" and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("error: cannot load the weights of ") and "AttributeError" in line
    assert "(hint: its own modelling code failed under transformers " in line
