"""How good is a ReFusion model's draft head where the decoder trusts it without a check?

    python -m refusion_cli.models.probe --model refusion-tiny --limit 50

ReFusion commits two kinds of token that no causal verification has accepted: the first token of
every slot (drafted by the plan pass) and the token forced by each round of the completion step.
Both are read from the logits at a ``<|mask|>`` placed right after a fully committed prefix (the
*next-position draft*). This probe teacher-forces reference responses and measures, at every
response position i, with the prompt and the reference response[:i] as context:

- ``ar``:    the causal prediction from the token at i-1 (shifted logits, what verification uses)
- ``draft``: the prediction at a ``<|mask|>`` placed at position i (unshifted logits)

Both are computed in one forward per response: the clean response, then one mask per position, each
mask seeing the prompt, the clean tokens before its position and itself.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from refusion_cli.training.objectives import model_attention_mask


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
                   attention_mask=model_attention_mask(model, allowed[None, None].to(device)), use_cache=False).logits[0]
    n_clean = n_prompt + n_response
    ar = logits[n_prompt - 1:n_clean - 1].argmax(-1)
    draft = logits[n_clean:].argmax(-1)
    return ar, draft


def probe(model: torch.nn.Module, tokenizer, problems: list[dict[str, str]], mask_token_id: int,
          eos_token_id: int) -> ProbeCounts:
    """Probe both heads on the reference answers of ``problems`` (records with 'question' and 'answer')."""
    from refusion_cli.models.chat import user_prompt_ids

    digit_ids = {i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()}
    counts = ProbeCounts()
    for problem in problems:
        prompt = user_prompt_ids(tokenizer, problem["question"])
        response = tokenizer.encode(problem["answer"], add_special_tokens=False) + [eos_token_id]
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


def main(argv: list[str] | None = None) -> None:
    from refusion_cli.cli.output import fail, quiet_library_output
    from refusion_cli.errors import UserError
    from refusion_cli.models.loading import load_model
    from refusion_cli.tasks.synthetic import read_jsonl

    parser = argparse.ArgumentParser(description="Next-position accuracy of the draft head vs the causal head.")
    parser.add_argument("--model", nargs="+", default=["refusion-tiny"], help="embedded names or directories")
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "evals" / "synthetic" / "test.jsonl")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--output", type=Path, default=None, help="write the rates as JSON here")
    args = parser.parse_args(argv)
    quiet_library_output()
    try:
        if args.limit < 1:
            raise UserError(f"--limit must be at least 1, got {args.limit}")
        if not args.data.is_file():
            raise UserError(f"no such file: {args.data}")
        problems = read_jsonl(args.data)[:args.limit]
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
    except UserError as exc:
        fail(str(exc), exc.hint)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"data": str(args.data), "problems": len(problems), "models": rows}, indent=2))


if __name__ == "__main__":
    main()
