"""How much batching can speed a decoder up on this machine, before any batch is run.

    python -m tools.batch_headroom --decoder refusion ar llada llada-fast-dllm --limit 64 --gen-length 192 --threads 2

A batch-1 decode spends its time in model calls of a few tokens each (AR: 1, ReFusion: its slots, LLaDA: its
whole canvas) plus its own step logic. Batching can at most bring a call's cost per token down to the model's
cheapest cost per token on this machine. For each decoder with an embedded model this decodes the prompts at
batch 1 on that model with the decoder's default there (``synthetic_tiny`` for ReFusion; ``spec.default_config``),
counts the tokens its calls fed, times the
model on inputs of [rows, tokens] without a cache over a small grid, and prints:

- the batch-1 wall time (the median of ``--decodes`` timed decodes of all prompts), its calls and the
  tokens each call fed on average;
- the floor: those tokens at the model's cheapest cost per token (the grid's minimum);
- the headroom: batch-1 wall time ÷ floor, an upper bound on batching's throughput gain that
  leaves out attention to the cache, padding and every cost outside the model.

Run it alone: other processes on the cores change the timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from refusion_cli.bench.prompts import load_prompts
from refusion_cli.decoding.batching import input_vocabulary
from refusion_cli.decoding.registry import DECODERS, decoder_spec
from refusion_cli.decoding.spec import default_config
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from tools import set_threads

GRID_ROWS = (1, 4, 16)
GRID_TOKENS = (1, 8, 32, 128)


def cost_per_token(model: torch.nn.Module, vocab: int, repeats: int) -> dict[tuple[int, int], float]:
    """Median seconds per fed token of one forward of [rows, tokens] random ids, for the grid."""
    costs = {}
    generator = torch.Generator().manual_seed(0)
    for rows in GRID_ROWS:
        for tokens in GRID_TOKENS:
            ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
            model(input_ids=ids, logits_to_keep=1)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1)
                times.append(time.perf_counter() - start)
            costs[rows, tokens] = statistics.median(times) / (rows * tokens)
    return costs


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    embedded = [name for name, spec in DECODERS.items() if spec.default_model is not None]
    parser.add_argument("--decoder", nargs="+", default=["refusion", "ar"], choices=embedded,
                        help="decoders with an embedded model")
    parser.add_argument("--limit", type=int, default=64, help="prompts of the synthetic task")
    parser.add_argument("--gen-length", type=int, default=192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timings per grid point")
    parser.add_argument("--decodes", type=int, default=3, help="timed batch-1 decodes of all prompts (median)")
    args = parser.parse_args(argv)
    for name in ("limit", "gen_length", "repeats", "decodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    set_threads(parser, args.threads)
    prompts = load_prompts(limit=args.limit)
    print(f"# Batching headroom on this machine ({args.threads} threads, {args.limit} prompts, "
          f"gen length {args.gen_length}, batch-1 seconds: median of {args.decodes} decodes)\n")
    print("| decoder | model | batch-1 seconds | calls | tokens fed | tokens per call | "
          "cost per token at batch 1 (µs) | cheapest cost per token (µs) | floor seconds | headroom |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    grids: dict[str, dict[tuple[int, int], float]] = {}  # each model's grid, timed once
    for decoder in args.decoder:
        name = str(decoder_spec(decoder).default_model)  # --decoder offers only decoders with one
        loaded = load_model(name, device="cpu", require_mask=decoder_spec(decoder).needs_mask)
        ids = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in prompts]
        config = default_config(decoder, name, args.gen_length)

        def decode(prompt_ids):
            return run_decoder(decoder, loaded.model, prompt_ids, config, mask_token_id=loaded.mask_token_id,
                               eos_token_id=loaded.stop_token_ids, batch_size=1)

        decode(ids[:1])  # warm-up
        walls = []
        for _ in range(args.decodes):
            start = time.perf_counter()
            results = decode(ids)
            walls.append(time.perf_counter() - start)
        wall = statistics.median(walls)
        calls = sum(result.stats.forwards for result in results)
        fed = sum(result.stats.positions for result in results)
        costs = grids.get(name) or cost_per_token(loaded.model, input_vocabulary(loaded.model), args.repeats)
        cheapest = min(costs.values())
        floor = fed * cheapest
        print(f"| {decoder} | {name} | {wall:.2f} | {calls} | {fed} | {fed / calls:.1f} | "
              f"{wall / fed * 1e6:.0f} | {cheapest * 1e6:.0f} | {floor:.2f} | {wall / floor:.1f}× |")
        grids[name] = costs
    for name, costs in grids.items():
        print(f"\nModel cost per fed token (µs) of {name}, one forward without a cache, median of {args.repeats}:\n")
        print("| rows \\ tokens | " + " | ".join(str(t) for t in GRID_TOKENS) + " |")
        print("|---|" + "---|" * len(GRID_TOKENS))
        for rows in GRID_ROWS:
            print(f"| {rows} | " + " | ".join(f"{costs[rows, t] * 1e6:.0f}" for t in GRID_TOKENS) + " |")


if __name__ == "__main__":
    main()
