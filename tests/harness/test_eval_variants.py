"""`refusion eval --causal-fix --causal-first --recheck`: ReFusion's decoding variants, a row each, each row
the variant's own decodes, resumable like any other row; the lm-eval adapter takes the same flags."""

from __future__ import annotations

import json

import pytest
import torch

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.registry import build_config
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.spec import preset_config
from refusion_cli.decoding.variants import asked_variants, variant_options
from refusion_cli.errors import UserError
from refusion_cli.harness.lm_adapters import ADAPTERS
from refusion_cli.harness.runner import EvalOptions, run_eval
from refusion_cli.harness.suite import EVALS_DIR
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import read_jsonl

LIMIT = 6  # of the first 6 problems, every variant answers at least one otherwise than the paper's decoder
ALL_LABELS = ["refusion:refusion-tiny", "refusion (causal fix):refusion-tiny", "refusion (causal first):refusion-tiny",
              "refusion (causal fix + first):refusion-tiny", "refusion (recheck):refusion-tiny",
              "refusion (causal fix + first + recheck):refusion-tiny"]
# (causal_fix, causal_first, recheck) asked -> the rows: by default one flag, its row beside the paper's; every
# combination of the three under `make test-all`
RUNS = [pytest.param((True, False, False), ALL_LABELS[:2], id="causal-fix"),
        pytest.param((True, True, True), ALL_LABELS, id="every-flag", marks=pytest.mark.slow)]


def variant_run(output, flags):
    causal_fix, causal_first, recheck = flags
    options = EvalOptions(tasks=["synthetic"], decoders=["refusion"], output=output, limit=LIMIT, device="cpu",
                          causal_fix=causal_fix, causal_first=causal_first, recheck=recheck)
    return run_eval(options)


def direct_tokens(variant) -> list[list[int]]:
    """The first problems decoded without lm-eval: the synthetic benchmark's config, chat prompts, seed 0."""
    loaded = load_model("refusion-tiny", "cpu")
    problems = read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")[:LIMIT]
    config = build_config("refusion", {"gen_length": 192}, base=preset_config("synthetic_tiny"))
    results = run_decoder("refusion", loaded.model, [user_prompt_ids(loaded.tokenizer, p["question"]) for p in problems],
                          config, mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids,
                          generator=[torch.Generator().manual_seed(0) for _ in problems], **variant_options(variant))
    return [result.tokens for result in results]


@pytest.mark.parametrize("flags, labels", RUNS)
def test_each_variant_is_a_row_of_its_own_decodes_and_resumes(tmp_path, flags, labels):
    results = variant_run(tmp_path / "run", flags)
    assert [r.label for r in results] == labels and {r.decoder for r in results} == {"refusion"}
    assert len({r.config_hash for r in results}) == len(labels)  # no row reuses another's samples
    loaded = load_model("refusion-tiny", "cpu")
    journals = sorted((tmp_path / "run" / "samples" / "synthetic").glob("*.jsonl"))
    records = [json.loads(line) for path in journals for line in path.read_text().splitlines()]
    assert len(journals) == len(labels) and len(records) == len(labels) * LIMIT
    paper = None
    for result, variant in zip(results, [(False, False, False), *asked_variants(*flags)], strict=True):
        lines = sorted((r for r in records if r["config_hash"] == result.config_hash), key=lambda r: r["doc_id"])
        expected = [loaded.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in direct_tokens(variant)]
        assert [line["output"] for line in lines] == expected
        assert result.tokens == sum(line["tokens"] for line in lines) and result.samples == LIMIT
        paper = paper or expected
        assert (expected != paper) == any(variant)  # the flags reached the decoder
    again = variant_run(tmp_path / "run", flags)
    assert [(r.label, r.resumed, r.decoded) for r in again] == [(label, LIMIT, 0) for label in labels]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert all(f"| {label} |" in summary for label in labels)


def test_variants_need_the_refusion_decoder():
    with pytest.raises(UserError, match=r"--causal-first applies to the refusion decoder, which is not among "
                                        r"the decoders given \(ar\)"):
        run_eval(EvalOptions(tasks=["synthetic"], decoders=["ar"], output=None, limit=1, causal_first=True))


def test_the_refusion_adapter_takes_the_variant_flags_as_model_args():
    adapter = ADAPTERS["refusion"].create_from_arg_string("pretrained=refusion-tiny,device=cpu,recheck=true,causal_fix=1")
    assert adapter.variant == {"causal_fix": True, "causal_first": False, "recheck": True}
    with pytest.raises(ConfigError, match="recheck applies to the refusion adapter only, not ar"):
        ADAPTERS["ar"].create_from_arg_string("pretrained=ar-tiny,device=cpu,recheck=true")
    with pytest.raises(ConfigError, match="causal_first: cannot read 'maybe' as a boolean"):
        ADAPTERS["refusion"].create_from_arg_string("pretrained=refusion-tiny,device=cpu,causal_first=maybe")


def test_every_mix_of_flags_has_a_label_of_its_own():
    import itertools

    from refusion_cli.decoding.variants import variant_label

    labels = [variant_label("refusion", flags) for flags in itertools.product((False, True), repeat=3)]
    assert labels == ["refusion", "refusion (recheck)", "refusion (causal first)", "refusion (causal first + recheck)",
                      "refusion (causal fix)", "refusion (causal fix + recheck)", "refusion (causal fix + first)",
                      "refusion (causal fix + first + recheck)"]
