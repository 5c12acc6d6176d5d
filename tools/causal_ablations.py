"""Accuracy and tokens per forward of ReFusion and its causal ablations on the synthetic test split.

    python -m tools.causal_ablations --limit 200 [--model CHECKPOINT]

Decodes the first ``--limit`` problems of evals/synthetic/test.jsonl with ``--model`` (the embedded
``refusion-tiny`` by default, or any ReFusion checkpoint directory) and the ``synthetic_tiny``
preset (``gen_length`` 192), greedy, six ways: the paper's decoder, ``causal_fix``,
``causal_first``, both, ``recheck``, and all three; prints a Markdown table (correct answers, mean tokens per forward as
``refusion bench`` counts it, tokens and forwards in all, slots started with the causal head's
token) and, for each ablation, the answers it turns right or wrong.
A batch decodes every row as alone, so ``--batch-size`` changes the time taken, never the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from refusion_cli.cli.output import fail
from refusion_cli.decoding import run_decoder
from refusion_cli.decoding.config import TOOLKIT_PRESETS
from refusion_cli.errors import UserError
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import is_correct, read_jsonl
from tools import set_threads

VARIANTS = {  # name -> run_decoder's ReFusion options
    "default": {},
    "causal_fix": {"causal_fix": True},
    "causal_first": {"causal_first": True},
    "both": {"causal_fix": True, "causal_first": True},
    "recheck": {"recheck": True},
    "all three": {"causal_fix": True, "causal_first": True, "recheck": True},
}
TEST_SPLIT = Path(__file__).resolve().parent.parent / "evals" / "synthetic" / "test.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=200, help="problems, from the start of the test split")
    parser.add_argument("--gen-length", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="refusion-tiny", help="embedded name or checkpoint directory")
    args = parser.parse_args(argv)
    for option in ("limit", "gen_length", "batch_size"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    set_threads(parser, args.threads)
    try:
        loaded = load_model(args.model, "cpu")
    except UserError as exc:
        fail(str(exc), exc.hint)
    problems = read_jsonl(TEST_SPLIT)[: args.limit]
    prompts = [user_prompt_ids(loaded.tokenizer, problem["question"]) for problem in problems]
    config = dataclasses.replace(TOOLKIT_PRESETS["synthetic_tiny"], gen_length=args.gen_length)
    print(f"{len(problems)} problems of {TEST_SPLIT.name}, {args.model}, synthetic_tiny with gen_length "
          f"{config.gen_length}\n")
    print("| decoder | correct | accuracy | tokens / forward | tokens | forwards | causal-first slots |")
    print("|---|---|---|---|---|---|---|")
    right: dict[str, list[bool]] = {}
    for name, options in VARIANTS.items():
        results = run_decoder("refusion", loaded.model, prompts, config, mask_token_id=loaded.mask_token_id,
                              eos_token_id=loaded.stop_token_ids, batch_size=args.batch_size, **options)
        right[name] = [is_correct(loaded.tokenizer.decode(result.tokens, skip_special_tokens=True),
                                  problem["target"]) for result, problem in zip(results, problems)]
        tpf = sum(result.stats.tpf for result in results) / len(results)
        tokens = sum(result.stats.tokens for result in results)
        forwards = sum(result.stats.forwards for result in results)
        firsts = sum(step.kinds.count("causal-first") for result in results for step in result.trace)
        correct = sum(right[name])
        print(f"| {name} | {correct} / {len(problems)} | {correct / len(problems):.1%} | {tpf:.3f} | {tokens} | "
              f"{forwards} | {firsts} |", flush=True)
    print()
    for name in list(VARIANTS)[1:]:
        gained = sum(now and not before for now, before in zip(right[name], right["default"]))
        lost = sum(before and not now for now, before in zip(right[name], right["default"]))
        print(f"{name}: {gained} answers turned right, {lost} turned wrong (against default)")


if __name__ == "__main__":
    main()
