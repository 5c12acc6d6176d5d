"""Where decoding time goes: wall time of decode calls vs time spent inside ``model.forward``.

    python -m tools.overhead --gen-length 256

Runs ReFusion (KV reuse and recompute) and AR decoding on a tiny randomly initialised Qwen3 of
the embedded models' size, on the CPU, and prints the share of each decode call spent inside the
model. Everything outside it (planning, verification bookkeeping, masks, cache cropping) is the
decoder's own overhead.
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion_cli.decoding.config import ARConfig, ReFusionConfig
from refusion_cli.decoding.engine import run_decoder
from refusion_cli.decoding.stats import DecodeStats
from tools import set_threads


def tiny_model(vocab: int, hidden: int, layers: int, seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=MAX_POSITIONS, initializer_range=0.3)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def summarise(name: str, runs: list[DecodeStats]) -> str:
    seconds = sum(s.seconds for s in runs)
    inside = sum(s.forward_seconds for s in runs)
    forwards = sum(s.forwards for s in runs)
    tokens = sum(s.tokens for s in runs)
    return (f"| {name} | {tokens / forwards:.2f} | {forwards / len(runs):.1f} | {seconds / len(runs) * 1000:.1f} | "
            f"{inside / seconds * 100:.1f}% |")


PROMPT_LENGTH = 48  # tokens of the random prompt every decode starts from
MAX_POSITIONS = 2048  # the tiny model's max_position_embeddings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--recompute", action="store_true", help="also time kv_reuse=False (slow: quadratic)")
    args = parser.parse_args(argv)
    for option in ("gen_length", "repeats", "hidden", "layers", "vocab"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.vocab < 3:
        parser.error("--vocab must be at least 3 (a mask id and prompt tokens)")
    if args.hidden % 8:  # 4 heads of an even size: rotary embeddings rotate pairs of dimensions
        parser.error(f"--hidden must be a multiple of 8 (4 heads of an even size), got {args.hidden}")
    if PROMPT_LENGTH + args.gen_length > MAX_POSITIONS:
        parser.error(f"--gen-length must be at most {MAX_POSITIONS - PROMPT_LENGTH} (the model's {MAX_POSITIONS} "
                     f"positions less the {PROMPT_LENGTH}-token prompt), got {args.gen_length}")
    if args.threads is not None:
        set_threads(parser, args.threads)
    model = tiny_model(args.vocab, args.hidden, args.layers, seed=0)
    mask_id = args.vocab - 1
    prompt = torch.randint(0, args.vocab - 2, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0))
    settings = {
        "refusion k=8 τ=0.9/0.9": ReFusionConfig(gen_length=args.gen_length, slot_size=8, slot_threshold=0.9,
                                                 token_threshold=0.9),
        "refusion k=8 τ=0.5/0.3": ReFusionConfig(gen_length=args.gen_length, slot_size=8, block_size=64,
                                                 slot_threshold=0.5, token_threshold=0.3),
        "refusion k=32 b=128 τ=0.9/0.4": ReFusionConfig(gen_length=args.gen_length, slot_size=32, block_size=128,
                                                       slot_threshold=0.9, token_threshold=0.4),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, hidden {args.hidden}, {args.layers} layers, "
          f"gen_length {args.gen_length}, {args.repeats} repeats (after one warm-up)\n")
    print("| decoder | tokens/forward | forwards | ms/decode | time inside model.forward |")
    print("|---|---|---|---|---|")
    for name, config in settings.items():
        for reuse in (True, False) if args.recompute else (True,):
            runs = []
            for repeat in range(args.repeats + 1):
                result = run_decoder("refusion", model, prompt, config, mask_token_id=mask_id, eos_token_id=None,
                                     kv_reuse=reuse)
                if repeat:
                    runs.append(result.stats)
            print(summarise(f"{name}{'' if reuse else ' (recompute)'}", runs))
    runs = [run_decoder("ar", model, prompt, ARConfig(gen_length=args.gen_length), mask_token_id=None,
                        eos_token_id=None).stats for _ in range(args.repeats + 1)][1:]
    print(summarise("ar", runs))


if __name__ == "__main__":
    main()
