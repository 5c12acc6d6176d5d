"""The lm-eval adapters: registration, model_args, generate_until's contract, exact log-likelihoods."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refusion_cli.decoding.spec import preset_config
from refusion_cli.decoding.config import PRESETS, ConfigError
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.errors import UserError
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.tasks.synthetic import read_jsonl
from refusion_cli.harness.suite import EVALS_DIR, load_suite

lm_adapters = pytest.importorskip("refusion_cli.harness.lm_adapters")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

QUESTION = read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[0]["question"]


def generation(context: str, **gen_kwargs) -> Instance:
    return Instance("generate_until", {}, (context, gen_kwargs), 0, ("synthetic", 0, 1))


@pytest.fixture(scope="module")
def ar(causal_checkpoint):
    return get_model("ar").create_from_arg_string(f"pretrained={causal_checkpoint},gen_length=24",
                                                  {"batch_size": 1, "device": "cpu"})


@pytest.fixture(scope="module")
def refusion(ar):
    return lm_adapters.ADAPTERS["refusion"](pretrained=ar.loaded, slot_size=4, block_size=8, gen_length=16)


@pytest.fixture(scope="module")
def prompt(ar) -> str:
    return ar.apply_chat_template([{"role": "user", "content": QUESTION}])


def test_the_four_adapters_are_registered_with_lm_eval():
    for name, cls in lm_adapters.ADAPTERS.items():
        assert get_model(name) is cls and cls.decoder == name


def test_model_args_become_the_decoder_config(causal_checkpoint):
    adapter = get_model("refusion").create_from_arg_string(
        f"pretrained={causal_checkpoint},slot_size=8,token_threshold=0.4,device=cpu")
    assert adapter.config.slot_size == 8 and adapter.config.token_threshold == 0.4
    from_preset = get_model("refusion").create_from_arg_string(
        f"pretrained={causal_checkpoint},preset=gsm8k,slot_threshold=0.5")
    assert from_preset.config == dataclasses.replace(PRESETS["gsm8k"], slot_threshold=0.5)
    from_suite = get_model("refusion").create_from_arg_string(f"pretrained={causal_checkpoint},preset=synthetic_tiny")
    assert from_suite.config == preset_config("synthetic_tiny")  # the toolkit's preset, as refusion eval takes


@pytest.mark.parametrize("arguments, last_line", [
    pytest.param(["--model", "refusion", "--model_args", "pretrained=refusion-tiny,preset=nope", "--tasks", "synthetic",
                  "--include_path", str(EVALS_DIR / "tasks")],
                 "error: unknown refusion preset 'nope'; choose one of mmlu_pro, ",
                 marks=pytest.mark.slow),  # `make test-all`: each case starts lm-eval, which indexes its
    # ~10k task files first (20-35 s); the adapters' own errors are checked in-process in this file
    pytest.param(["--model", "refusion", "--model_args", "pretrained=refusion-tiny", "--tasks", "no_such_task"],
                 "error: Tasks not found: no_such_task (hint: check --tasks", marks=pytest.mark.slow),
    # the task files of evals/ are templates that refusion eval fills in (datasets raised FileNotFoundError)
    pytest.param(["--model", "ar", "--model_args", "pretrained=ar-tiny,gen_length=8", "--tasks", "synthetic",
                  "--include_path", str(EVALS_DIR / "tasks")],
                 "error: the task files in evals/tasks are templates whose data paths are filled in by refusion "
                 "eval (hint: run refusion eval", marks=pytest.mark.slow),
], ids=["bad-preset", "unknown-task", "task-template"])
def test_a_mistake_on_lm_evals_command_line_is_one_error_line(tmp_path, arguments, last_line):
    import subprocess
    import sys

    from tests.envs import cache_env

    out = subprocess.run([sys.executable, "-m", "refusion_cli", "lm-eval", "run", *arguments, "--device", "cpu",
                          "--limit", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **cache_env()})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith(last_line)


def test_a_key_from_model_args_and_the_command_line_must_agree():
    # lm-eval passes --device / --batch_size next to model_args; the same key twice was a TypeError
    with pytest.raises(ConfigError, match=r"^device is given twice: 'foo' in model_args and 'cpu' from the "
                                          r"command line \(--device\); give it once$"):
        get_model("ar").create_from_arg_string("pretrained=/nonexistent,device=foo",
                                               {"device": "cpu", "batch_size": None})
    # equal values merge, and the adapter's own checks run on them
    with pytest.raises(UserError, match="unknown device 'foo'"):
        get_model("ar").create_from_arg_string("pretrained=/nonexistent,device=foo,batch_size=1",
                                               {"device": "foo", "batch_size": "1"})


@pytest.mark.parametrize("model_args, message", [
    ("slot_size=8,bogus=1", "bogus"),  # neither a decoder option nor an adapter option
    ("slot_sise=8", "slot_sise"),
    ("steps=8", "steps"),  # an LLaDA option is not a ReFusion one
    ("preset=nope", "nope"),
    ("batch_size=many", "batch_size"),
    ("max_memory=2GiB", "max_memory and max_batch_size bound batch_size=auto"),
    ("batch_size=auto,max_memory=lots", "cannot read 'lots' as a memory size"),
    ("slot_size=abc", "slot_size"),
])
def test_bad_model_args_are_errors_before_loading(model_args, message):
    with pytest.raises(ConfigError, match=message):
        get_model("refusion").create_from_arg_string(f"pretrained=/nonexistent,{model_args}")


@pytest.mark.parametrize("device, message", [("foo", "unknown device 'foo'"), ("cuda", "no usable CUDA device")])
def test_a_bad_device_is_one_user_error_before_loading(device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match=message):
        get_model("ar").create_from_arg_string(f"pretrained=/nonexistent,device={device}")


def test_the_chat_template_hook_matches_the_projects_prompt(ar, prompt):
    assert ar.tok_encode(prompt) == user_prompt_ids(ar.tokenizer, QUESTION)
    assert ar.tokenizer_name and ar.chat_template(True)


def test_generate_until_decodes_like_the_decoder_and_records_stats(ar, prompt):
    [text] = ar.generate_until([generation(prompt, until=[], max_gen_toks=24)])
    direct = run_decoder("ar", ar.model, ar.tok_encode(prompt), ar.config, mask_token_id=None,
                         eos_token_id=ar.loaded.eos_token_id)
    assert text == ar.tok_decode(direct.tokens)
    sample = ar.samples[-1]
    assert sample.text == text and sample.stats.tokens == len(direct.tokens) == sample.stats.forwards
    assert sample.stats.seconds > 0 and sample.stats.tps > 0


def test_the_first_decode_is_preceded_by_an_untimed_warm_up(causal_checkpoint, prompt):
    adapter = lm_adapters.ADAPTERS["ar"](pretrained=str(causal_checkpoint), device="cpu", gen_length=24)
    calls = []
    handle = adapter.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        first = adapter.generate_until([generation(prompt, until=[], max_gen_toks=6)])
        assert len(calls) == 2 * 6 and len(adapter.samples) == 1  # the warm-up decode is not a sample
        calls.clear()
        assert adapter.generate_until([generation(prompt, until=[], max_gen_toks=6)]) == first
        assert len(calls) == 6 and len(adapter.samples) == 2  # once per adapter
    finally:
        handle.remove()


def test_a_prompt_too_long_for_the_model_keeps_its_end_and_says_how_much_was_cut(ar, prompt):
    long_prompt = "word " * 1100 + prompt
    ids = ar.tok_encode(long_prompt)
    [text] = ar.generate_until([generation(long_prompt, until=[], max_gen_toks=24)])
    sample = ar.samples[-1]
    assert sample.prompt_tokens == ar.max_length - 24 and sample.prompt_cut == len(ids) - (ar.max_length - 24) > 0
    direct = run_decoder("ar", ar.model, ids[sample.prompt_cut:], ar.config, mask_token_id=None,
                         eos_token_id=ar.loaded.eos_token_id)
    assert text == ar.tok_decode(direct.tokens)
    ar.generate_until([generation(prompt, until=[], max_gen_toks=24)])
    assert ar.samples[-1].prompt_cut == 0


def test_max_gen_toks_is_the_response_budget(ar, refusion, prompt):
    for adapter, budget in ((ar, 5), (refusion, 8)):
        adapter.generate_until([generation(prompt, until=[], max_gen_toks=budget)])
        assert 0 < adapter.samples[-1].stats.tokens <= budget
    ar.generate_until([generation(prompt, until=[], max_gen_toks=3)])
    assert ar.samples[-1].stats.forwards == ar.samples[-1].stats.tokens <= 3


def test_until_cuts_the_text_at_the_earliest_stop_string(ar, prompt):
    [full] = ar.generate_until([generation(prompt, until=[], max_gen_toks=24)])
    assert len(full) > 6
    late, early = full[5:7], full[2:4]
    [cut] = ar.generate_until([generation(prompt, until=[late, early], max_gen_toks=24)])
    assert cut == full[: min(full.find(late), full.find(early))]
    [single] = ar.generate_until([generation(prompt, until=early, max_gen_toks=24)])
    assert single == full[: full.find(early)]


def test_outputs_do_not_depend_on_request_order(refusion, prompt):
    other = refusion.apply_chat_template([{"role": "user", "content": "Mia has 3 apples."}])
    first = refusion.generate_until([generation(prompt), generation(other)])
    second = refusion.generate_until([generation(other), generation(prompt)])
    assert first == second[::-1]


def test_unknown_generation_keys_are_errors(ar, prompt):
    with pytest.raises(UserError, match="num_beams"):
        ar.generate_until([generation(prompt, num_beams=4)])


def hand_logprob(model, ids: list[int], start: int) -> tuple[float, bool]:
    """Sum of log p(ids[i] | ids[:i]) for i >= start, from one full forward, in float64."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]
    greedy = all(int(logprobs[i - 1].argmax()) == ids[i] for i in range(start, len(ids)))
    return sum(picked), greedy


@pytest.mark.parametrize("name", ["ar", "refusion"])
def test_loglikelihood_is_exact(name, ar, refusion):
    adapter = ar if name == "ar" else refusion
    context, continuation = "Mia has 3 apples. She buys", " 4 more apples."
    [(score, greedy)] = adapter.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    whole = adapter.tok_encode(context + continuation)
    start = len(adapter.tok_encode(context))
    expected, expected_greedy = hand_logprob(adapter.model, whole, start)
    assert score == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    assert score < 0


def test_loglikelihood_rolling_scores_every_token_after_the_prefix(ar):
    text = "Leo has 12 marbles."
    [total] = ar.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    expected, _ = hand_logprob(ar.model, [ar.prefix_token_id, *ar.tok_encode(text)], 1)
    assert total == pytest.approx(expected, abs=1e-4)


def test_mdm_adapters_refuse_loglikelihood(bidirectional_checkpoint):
    llada = lm_adapters.ADAPTERS["llada"](pretrained=str(bidirectional_checkpoint), gen_length=32, steps=32, block_length=32)
    with pytest.raises(UserError, match="log-likelihood"):
        llada.loglikelihood([Instance("loglikelihood", {}, ("a", " b"), 0)])
    with pytest.raises(UserError, match="log-likelihood"):
        llada.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("a b",), 0)])
    [text] = llada.generate_until([generation("Mia has", until=[], max_gen_toks=32)])
    assert isinstance(text, str) and llada.samples[-1].stats.forwards == 32


def test_a_decoder_on_the_wrong_model_family_is_refused(bidirectional_checkpoint):
    with pytest.raises(UserError, match="causal"):
        lm_adapters.ADAPTERS["ar"](pretrained=str(bidirectional_checkpoint))
