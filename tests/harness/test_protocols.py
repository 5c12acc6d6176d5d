"""``--protocol lm-eval`` renders what the installed lm-eval's own tasks render; ``--protocol`` reaches the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from refusion_cli.harness.lm_adapters import DecoderLM
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.harness.evaluation import seed_lm_eval
from refusion_cli.harness.runner import EvalOptions
from refusion_cli.harness.suite import _TagTolerantLoader, lm_eval_tasks_dir, load_suite, load_tasks, render
from refusion_cli.errors import UserError

PAPER_DATA = Path(__file__).parent / "paper_data"
# benchmark -> (the lm-eval task compared, its stock YAML under lm_eval/tasks, its local data file)
INCLUDED = {
    "gsm8k": ("gsm8k_cot", "gsm8k/gsm8k-cot.yaml", "gsm8k/test.jsonl"),
    "arc_challenge": ("arc_challenge_chat", "arc/arc_challenge_chat.yaml", "arc_challenge/test.jsonl"),
    "gpqa": ("gpqa_main_generative_n_shot", "gpqa/generative/gpqa_main_generative_n_shot.yaml", "gpqa/gpqa_main.jsonl"),
    "mmlu_pro": ("mmlu_pro_biology", "mmlu_pro/mmlu_pro_biology.yaml", "mmlu_pro/test.jsonl"),
    "math": ("minerva_math_algebra", "minerva_math/minerva_math_algebra.yaml", "minerva_math/algebra.jsonl"),
}
# the code tasks are written out (lm-eval's import a hub metric): these keys are what they render with
RENDERING_KEYS = ("doc_to_text", "doc_to_target", "gen_prefix", "target_delimiter", "generation_kwargs", "description")


class Template:
    """The adapters' chat template call on the Qwen3 tokenizer, as a model without enable_thinking passes it."""

    apply_chat_template = DecoderLM.apply_chat_template

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.chat_template_args = tokenizer, {}


@pytest.fixture(scope="module")
def template() -> Template:
    from tools.paper_parity import byte_level_tokenizer

    return Template(byte_level_tokenizer())


def requests(task: Any, template: Template) -> list[tuple[str, dict]]:
    task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(apply_chat_template=True, fewshot_as_multiturn=True,
                            chat_template=template.apply_chat_template, tokenizer_name="qwen3")
    return [(instance.args[0], instance.args[1]) for instance in sorted(task.instances, key=lambda i: i.doc_id)]


def stock_task(relative: str, data_file: Path, split: str) -> Any:
    """lm-eval's own task from its YAML, reading ``data_file`` instead of the hub."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's own reader of its task files (includes, !function)

    config = load_yaml(lm_eval_tasks_dir() / relative)
    config.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {split: str(data_file)}},
                  fewshot_split=None)
    if split == "test":  # zero-shot: no other split is read
        config.update(training_split=None, validation_split=None)
    config.pop("fewshot_config", None)
    return ConfigurableTask(config=config)


@pytest.mark.parametrize("name", sorted(INCLUDED))
def test_lm_eval_protocol_renders_what_lm_evals_own_task_renders(name, template, tmp_path):
    task_name, relative, data = INCLUDED[name]
    benchmark = load_suite(protocol=EvalProtocol.LM_EVAL).benchmarks[name]
    seed_lm_eval(0)
    ours = load_tasks(render(benchmark, tmp_path, data_dir=PAPER_DATA), tmp_path)["tasks"]
    task = next(t for key, t in ours.items() if key.endswith(task_name))
    seed_lm_eval(0)
    stock = stock_task(relative, (PAPER_DATA / data).resolve(), "train" if name == "gpqa" else "test")
    mine = requests(task, template)
    assert len(mine) >= 2  # MMLU-Pro: two hand-made documents per subject; the others: 24 or 50
    assert mine == requests(stock, template)


@pytest.mark.parametrize("name, stock", [("humaneval", "humaneval/humaneval_instruct.yaml"), ("mbpp", "mbpp/mbpp.yaml")])
def test_lm_eval_protocol_code_tasks_render_with_lm_evals_own_settings(name, stock):
    def settings(path: Path) -> dict:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TagTolerantLoader)
        if "include" in config:
            config = {**settings(path.parent / config["include"]), **config}
        return {key: config.get(key) for key in RENDERING_KEYS}

    ours = settings(load_suite(protocol=EvalProtocol.LM_EVAL).benchmarks[name].yaml)
    assert ours == settings(lm_eval_tasks_dir() / stock)


def test_the_paper_protocol_is_the_default_and_a_misspelt_one_is_refused(tmp_path):
    assert EvalOptions(tasks=["gsm8k"], decoders=["ar"], output=tmp_path).protocol is EvalProtocol.PAPER
    with pytest.raises(UserError, match="unknown protocol 'lm_eval'; choose from paper, lm-eval"):
        EvalOptions(tasks=["gsm8k"], decoders=["ar"], output=tmp_path, protocol="lm_eval")


def test_a_sample_journaled_under_one_protocol_is_not_reused_under_the_other():
    """MATH's prompts are the same under both protocols and its scoring is not: the journal key must differ."""
    from refusion_cli.decoding.config import ReFusionConfig
    from refusion_cli.harness.runner import config_hash

    args = ("refusion", ReFusionConfig(), "model", 0, True, ("cpu", "float32"), "math_verify,none")
    lm_eval_protocol = config_hash(*args, protocol=EvalProtocol.LM_EVAL)
    assert config_hash(*args, protocol=EvalProtocol.PAPER) != lm_eval_protocol
    assert config_hash(*args) == lm_eval_protocol  # the hashes journals written before the protocols have
