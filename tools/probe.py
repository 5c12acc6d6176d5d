"""How good is a ReFusion model's draft head where the decoder trusts it without a check?

    python -m tools.probe --model refusion-tiny --limit 50

ReFusion commits two kinds of token that no causal verification has accepted: the first token of
every slot (drafted by the plan pass) and the token forced by each round of the completion step.
Both are read from the logits at a ``<|mask|>`` placed right after a fully committed prefix (the
*next-position draft*). This probe teacher-forces reference responses and measures, at every
response position i, with the prompt and the reference response[:i] as context:

- ``ar``:    the causal prediction from the token at i-1 (shifted logits, what verification uses)
- ``draft``: the prediction at a ``<|mask|>`` placed at position i (unshifted logits)

Both are computed in one forward per response: the clean response, then one mask per position, each
mask seeing the prompt, the clean tokens before its position and itself.

With ``--errors`` it also decodes every problem with ReFusion and, in each wrong answer, finds the
first token that differs from the reference answer and how the decoder committed it: as a slot's
first token, verified by the causal head, or forced by the completion step (``StepTrace.kinds``);
and whether tokens to its left were still uncommitted at that moment. It does the same with the
decoder's ``causal_fix`` ablation (the causal head's token in place of each forced one).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from refusion_cli.cli.output import fail, quiet_library_output
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.spec import preset_config
from refusion_cli.errors import UserError
from refusion_cli.jsonl import json_objects, read_text
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from refusion_cli.paths import check_output_dir
from refusion_cli.tasks.synthetic import is_correct
from refusion_cli.training.objectives import model_attention_mask

REPO = Path(__file__).resolve().parents[1]


@dataclass
class ProbeCounts:
    """Top-1 hits of the two heads over the probed response positions (``digits``: digit tokens only)."""

    positions: int = 0
    ar_correct: int = 0
    draft_correct: int = 0
    digits: int = 0
    ar_digits_correct: int = 0
    draft_digits_correct: int = 0

    def rates(self) -> dict[str, float]:
        def rate(hits: int, total: int) -> float:
            return hits / total if total else float("nan")

        return {"ar": rate(self.ar_correct, self.positions), "draft": rate(self.draft_correct, self.positions),
                "ar_digits": rate(self.ar_digits_correct, self.digits),
                "draft_digits": rate(self.draft_digits_correct, self.digits)}


def probe_layout(n_prompt: int, n_response: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [N], allowed [N, N]) for prompt + response + one mask per response position."""
    n_clean = n_prompt + n_response
    total = n_clean + n_response
    positions = torch.cat([torch.arange(n_clean), torch.arange(n_prompt, n_clean)])
    allowed = torch.zeros(total, total, dtype=torch.bool)
    allowed[:n_clean, :n_clean] = torch.ones(n_clean, n_clean, dtype=torch.bool).tril()
    for i in range(n_response):
        query = n_clean + i
        allowed[query, :n_prompt + i] = True  # the prompt and the response before position i
        allowed[query, query] = True  # and itself
    return positions, allowed


@torch.no_grad()
def head_predictions(model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int],
                     mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ar [R], draft [R]): each head's argmax for every response position, teacher-forced."""
    n_prompt, n_response = len(prompt_ids), len(response_ids)
    if n_prompt == 0 or n_response == 0:
        raise ValueError("the probe needs a non-empty prompt and response")
    device = next(model.parameters()).device
    ids = torch.tensor([*prompt_ids, *response_ids, *([mask_token_id] * n_response)], device=device)
    positions, allowed = probe_layout(n_prompt, n_response)
    logits = model(input_ids=ids[None], position_ids=positions[None].to(device),
                   attention_mask=model_attention_mask(model, allowed[None, None].to(device)),
                   use_cache=False).logits[0]
    n_clean = n_prompt + n_response
    ar = logits[n_prompt - 1:n_clean - 1].argmax(-1)
    draft = logits[n_clean:].argmax(-1)
    return ar, draft


def reference_ids(tokenizer, problem: dict[str, str], eos_token_id: int) -> list[int]:
    """The reference answer's token ids, ending with EOS, as the model was trained to write it."""
    return tokenizer.encode(problem["answer"], add_special_tokens=False) + [eos_token_id]


def probe(model: torch.nn.Module, tokenizer, problems: list[dict[str, str]], mask_token_id: int,
          eos_token_id: int) -> ProbeCounts:
    """Probe both heads on the reference answers of ``problems`` (records with 'question' and 'answer')."""
    digit_ids = {i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()}
    counts = ProbeCounts()
    for problem in problems:
        prompt = user_prompt_ids(tokenizer, problem["question"])
        response = reference_ids(tokenizer, problem, eos_token_id)
        ar, draft = head_predictions(model, prompt, response, mask_token_id)
        target = torch.tensor(response, device=ar.device)
        is_digit = torch.tensor([t in digit_ids for t in response], device=ar.device)
        counts.positions += len(response)
        counts.ar_correct += int((ar == target).sum())
        counts.draft_correct += int((draft == target).sum())
        counts.digits += int(is_digit.sum())
        counts.ar_digits_correct += int(((ar == target) & is_digit).sum())
        counts.draft_digits_correct += int(((draft == target) & is_digit).sum())
    return counts


@dataclass
class ErrorAttribution:
    """Where ReFusion's wrong answers go wrong, by how the first differing token was committed."""

    problems: int = 0
    wrong: int = 0
    first_wrong: Counter = field(default_factory=Counter)  # kind of the first differing token, per wrong answer
    first_wrong_gap: int = 0  # ... of which committed while a token to its left was not yet committed
    committed: Counter = field(default_factory=Counter)  # tokens up to the first difference, per kind
    committed_wrong: Counter = field(default_factory=Counter)  # ... of which differ from the reference
    tokens: int = 0  # response tokens and model calls of all decodes
    forwards: int = 0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(1, self.forwards)

    def as_dict(self) -> dict[str, object]:
        return {"problems": self.problems, "wrong": self.wrong, "tokens_per_forward": self.tokens_per_forward,
                "first_wrong": dict(self.first_wrong),
                "first_wrong_with_uncommitted_left_context": self.first_wrong_gap,
                "committed": dict(self.committed), "committed_wrong": dict(self.committed_wrong)}


def first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where the two differ (a length difference counts); None if equal."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def attribute(tokens: Sequence[int], trace: Sequence, reference: Sequence[int], wrong: bool,
              counts: ErrorAttribution) -> None:
    """Add one decode (response ``tokens`` and its ReFusion ``trace``) against ``reference`` to ``counts``."""
    kind, order = {}, {}
    for step in trace:
        for offset, step_kind in zip(step.offsets, step.kinds):
            kind[offset], order[offset] = step_kind, len(order)
    differs = first_difference(tokens, reference)
    last = differs if differs is not None else len(tokens) - 1
    for offset in range(min(last + 1, len(tokens), len(reference))):
        counts.committed[kind[offset]] += 1
        if tokens[offset] != reference[offset]:
            counts.committed_wrong[kind[offset]] += 1
    counts.problems += 1
    if not wrong:
        return
    counts.wrong += 1
    if differs is None or differs >= len(tokens):
        counts.first_wrong["none (ends early)" if differs is not None else "none (same tokens)"] += 1
        return
    counts.first_wrong[kind[differs]] += 1
    counts.first_wrong_gap += int(any(order[offset] > order[differs] for offset in range(differs)))


def attribute_errors(loaded, problems: list[dict[str, str]], config, causal_fix: bool = False) -> ErrorAttribution:
    """Decode ``problems`` with ReFusion (``config``; ``causal_fix``: the decoder's ablation) and attribute
    every wrong answer (see the module)."""
    tokenizer, counts = loaded.tokenizer, ErrorAttribution()
    for problem in problems:
        result = run_decoder("refusion", loaded.model, user_prompt_ids(tokenizer, problem["question"]), config,
                             mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids,
                             causal_fix=causal_fix)
        counts.tokens += result.stats.tokens
        counts.forwards += result.stats.forwards
        reference = reference_ids(tokenizer, problem, loaded.eos_token_id)
        text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        attribute(result.tokens, result.trace, reference, not is_correct(text, problem["target"]), counts)
    return counts


PROBLEM_FIELDS = ("question", "answer", "target")  # what the probe and --errors read from a record


def read_problems(path: Path, limit: int) -> list[dict[str, str]]:
    """The first ``limit`` records of a JSON-lines file in the synthetic task's format; a missing, empty or
    malformed file, or a record without a string question, answer and target, is a UserError naming it."""
    if not path.is_file():
        raise UserError(f"--data {path} does not exist or is not a file")
    hint = "give --data records of the synthetic task's format: question, answer (ending in '#### N') and target"
    problems = []
    for number, record in json_objects(read_text(path, f"--data {path}"), f"--data {path}", hint):
        missing = [name for name in PROBLEM_FIELDS if not isinstance(record.get(name), str)]
        if missing:
            raise UserError(f"--data {path}, line {number}, has no string field {', '.join(missing)}", hint=hint)
        problems.append(record)
        if len(problems) == limit:
            break
    if not problems:
        raise UserError(f"--data {path} holds no problems", hint=hint)
    return problems


def check_output_file(path: Path) -> None:
    """``--output``: a file that can be created (checked before the models run, not after)."""
    if path.is_dir():
        raise UserError(f"--output {path} is a directory; give a file name for the JSON")
    check_output_dir(path.parent, hint="give --output a file in a folder you can write to")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Next-position accuracy of the draft head vs the causal head.")
    parser.add_argument("--model", nargs="+", default=["refusion-tiny"], help="embedded names or directories")
    parser.add_argument("--data", type=Path, default=REPO / "evals" / "synthetic" / "test.jsonl")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--output", type=Path, default=None, help="write the rates as JSON here")
    parser.add_argument("--errors", action="store_true",
                        help="also decode with ReFusion and attribute each wrong answer's first wrong token")
    parser.add_argument("--preset", default="synthetic_tiny", help="ReFusion settings for --errors")
    parser.add_argument("--gen-length", type=int, default=192, help="response budget for --errors")
    args = parser.parse_args(argv)
    quiet_library_output()
    try:
        if args.limit < 1:
            raise UserError(f"--limit must be at least 1, got {args.limit}")
        problems = read_problems(args.data, args.limit)
        config = replace(preset_config(args.preset), gen_length=args.gen_length) if args.errors else None
        if args.output is not None:
            check_output_file(args.output)
        rows = {}
        print("| model | positions | AR head | draft head | digits | AR head, digits | draft head, digits |")
        print("|---|---|---|---|---|---|---|")
        for name in args.model:
            loaded = load_model(name, device="cpu")
            counts = probe(loaded.model, loaded.tokenizer, problems, loaded.mask_token_id, loaded.eos_token_id)
            rates = counts.rates()
            rows[name] = {**asdict(counts), **rates}
            print(f"| {name} | {counts.positions} | {rates['ar']:.1%} | {rates['draft']:.1%} | {counts.digits} | "
                  f"{rates['ar_digits']:.1%} | {rates['draft_digits']:.1%} |", flush=True)
            if config is not None:
                for key, causal_fix in (("errors", False), ("errors_causal_fix", True)):
                    errors = attribute_errors(loaded, problems, config, causal_fix)
                    rows[name][key] = {"preset": args.preset, "gen_length": args.gen_length, **errors.as_dict()}
                    label = "ReFusion" if not causal_fix else "ablation causal_fix=True"
                    print(f"  {label} ({args.preset}, gen length {args.gen_length}): {errors.wrong} of "
                          f"{errors.problems} wrong, {errors.tokens_per_forward:.2f} tokens/forward; "
                          "first wrong token: "
                          + ", ".join(f"{kind} {n}" for kind, n in errors.first_wrong.most_common())
                          + f" ({errors.first_wrong_gap} with uncommitted tokens to its left)", flush=True)
                    print("    committed tokens up to the first difference, wrong / all: "
                          + ", ".join(f"{kind} {errors.committed_wrong[kind]} / {n}"
                                      for kind, n in errors.committed.most_common()), flush=True)
        if args.output is not None:
            write_rates(args.output, {"data": str(args.data), "problems": len(problems), "models": rows})
    except UserError as exc:
        fail(str(exc), exc.hint)


def write_rates(path: Path, payload: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
    except OSError as exc:
        raise UserError(f"cannot write --output {path}: {exc.strerror or exc}") from None


if __name__ == "__main__":
    main()
