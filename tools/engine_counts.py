"""What a batched decode costs besides the model's arithmetic, counted the same way on two revisions: the
positions the model computed per generated token (padding included), the K/V bytes the cache code copied per
generated token, and the host syncs per model call.

    python -m tools.engine_counts --before REV [--after REV] --out results/bench-batch/counts.md \
        [--decoders refusion ar] [--batch-sizes 1 16] [--limit 48] [--gen-length 192]

Each revision decodes the held-out synthetic prompts (the first ``--limit``) on the embedded models in a child
process of its own; ``--before`` / ``--after`` check the revision out with ``git worktree`` into a temporary
folder and import the library from there (no ``--after``: this working tree). The counts do not depend on the
machine (one thread, float32 on the CPU); nothing is timed.

How each is counted, identically for every revision (a ``TorchFunctionMode`` sees every torch call):

- positions: the ``input_ids`` elements of every call of the model (a padded call counts its padding);
- K/V bytes copied: bytes written into tensors shaped like a layer's K/V ([rows, kv heads, columns, head dim])
  by ``cat``, ``gather``, ``index_select``, ``pad``, item assignment, ``index_put`` and ``copy_``, less the
  bytes of the K/V the model computed for the positions it was fed (which any cache writes once): what is
  left is K/V moved or rewritten that was computed before;
- host syncs: ``item``, ``tolist``, ``bool()`` / ``int()`` / ``float()`` / ``index()`` of a tensor, ``nonzero``
  and indexing with a boolean tensor, each a point where a GPU run would wait for the device (on a CPU they
  cost nothing, which is why they are counted rather than timed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
WRITES = {"cat", "gather", "index_select", "pad", "__setitem__", "index_put_", "index_put", "copy_"}


def child(args: argparse.Namespace) -> None:
    """Decode and count in this process, the library imported from ``--source`` when given."""
    if args.source:
        sys.path.insert(0, args.source)
    import torch
    from torch.overrides import TorchFunctionMode

    torch.set_num_threads(1)
    from refusion_cli.bench.prompts import synthetic_prompts
    from refusion_cli.decoding.registry import build_config
    from refusion_cli.models.chat import user_prompt_ids
    from refusion_cli.models.loading import load_model
    try:
        from refusion_cli.decoding.engine import run_decoder
    except ImportError:  # a revision before the engine
        from refusion_cli.decoding.registry import run_decoder  # type: ignore[attr-defined,no-redef]

    loaded = load_model(args.model, device="cpu", require_mask=args.decoder != "ar")
    config = loaded.model.config
    kv_heads, head_dim = config.num_key_value_heads, getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    layers = config.num_hidden_layers

    def kv_shaped(tensor: Any) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[1] == kv_heads
                and tensor.shape[3] == head_dim)

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.syncs = self.written = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            out = func(*args, **kwargs)
            if name in SYNCS:
                self.syncs += 1
            elif name == "__getitem__" and _bool_index(args[1], torch):
                self.syncs += 1
            if name in WRITES:
                target = args[0] if name in {"__setitem__", "index_put_", "copy_"} else out
                if kv_shaped(target):
                    source = args[2] if name == "__setitem__" else (args[1] if name == "copy_" else out)
                    if name in {"index_put_", "index_put"}:
                        source = args[2] if len(args) > 2 else kwargs.get("values")
                    if isinstance(source, torch.Tensor):
                        self.written += source.numel() * source.element_size()
            return out

    positions = [0]
    calls = [0]

    def fed(module: Any, call_args: tuple, call_kwargs: dict) -> None:
        ids = call_kwargs.get("input_ids", call_args[0] if call_args else None)
        positions[0] += ids.numel()
        calls[0] += 1

    prompts = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in synthetic_prompts(args.limit)]
    built = build_config(args.decoder, {"gen_length": args.gen_length})
    special = {"mask_token_id": loaded.mask_token_id, "eos_token_id": loaded.stop_token_ids}
    handle = loaded.model.register_forward_pre_hook(fed, with_kwargs=True)
    counter = Count()
    with counter, torch.no_grad():
        results = run_decoder(args.decoder, loaded.model, prompts, built, batch_size=args.batch_size, **special)
    handle.remove()
    tokens = sum(result.stats.tokens for result in results)
    element = next(loaded.model.parameters()).element_size()
    fresh = positions[0] * kv_heads * head_dim * element * 2 * layers  # K and V of every position fed, every layer
    print(json.dumps({"decoder": args.decoder, "batch_size": args.batch_size, "tokens": tokens, "calls": calls[0],
                      "positions": positions[0], "kv_copied": max(0, counter.written - fresh),
                      "syncs": counter.syncs, "answers": [result.tokens for result in results]}))


def _bool_index(index: Any, torch: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


MODELS = {"refusion": "refusion-tiny", "ar": "ar-tiny", "llada": "mdm-tiny"}


def measure(source: Path | None, decoder: str, batch_size: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "tools.engine_counts", "--child", "--decoder", decoder, "--model",
               MODELS[decoder], "--batch-size", str(batch_size), "--limit", str(args.limit), "--gen-length",
               str(args.gen_length)] + (["--source", str(source)] if source else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def table(results: list[dict], before: str, after: str, command: str) -> str:
    lines = [f"# What the engine costs besides the model (before `{before}`, after `{after}`)", "",
             f"`{command}`", "",
             "Per decoder and batch size: positions the model computed per generated token (padding included), "
             "K/V bytes the cache code copied per generated token, host syncs per model call (points where a GPU "
             "run waits for the device), and the model calls. Counted, not timed (tools/engine_counts.py "
             "says how); the answers of both revisions are compared. The decoders run at their default settings "
             "on the first held-out synthetic problems (the command says how many).", "",
             "| decoder | batch | positions / token, before → after | K/V bytes copied / token, before → after "
             "| host syncs / call, before → after | calls, before → after | same answers |",
             "|---|---|---|---|---|---|---|"]
    pairs: dict[tuple[str, int], dict[str, dict]] = {}
    for result in results:
        pairs.setdefault((result["decoder"], result["batch_size"]), {})[result["revision"]] = result
    for (decoder, size), pair in pairs.items():
        old, new = pair["before"], pair["after"]
        cells = []
        for key, per in (("positions", "tokens"), ("kv_copied", "tokens"), ("syncs", "calls")):
            cells.append(f"{old[key] / old[per]:,.1f} → {new[key] / new[per]:,.1f}")
        cells.append(f"{old['calls']:,} → {new['calls']:,}")
        cells.append("yes" if old["answers"] == new["answers"] else "no")
        lines.append(f"| {decoder} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.engine_counts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the git revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--after", help="the git revision measured as 'after' (default: this working tree)")
    parser.add_argument("--decoders", nargs="+", default=["refusion", "ar"], choices=sorted(MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--gen-length", type=int, default=192)
    parser.add_argument("--out", type=Path, help="the Markdown table to write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--decoder", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    if not args.before or args.out is None:
        parser.error("give --before REV and --out FILE")
    revision = lambda rev: subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True,
                                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        sources: dict[str, Path | None] = {"before": Path(scratch) / "before", "after": None}
        if args.after:
            sources["after"] = Path(scratch) / "after"
        for name, folder in sources.items():
            if folder is not None:
                subprocess.run(["git", "worktree", "add", "--detach", str(folder), getattr(args, name)],
                               check=True, capture_output=True)
        try:
            results = []
            for decoder in args.decoders:
                for size in args.batch_sizes:
                    for name, folder in sources.items():
                        result = {"revision": name, **measure(folder, decoder, size, args)}
                        print(json.dumps({k: v for k, v in result.items() if k != "answers"}), flush=True)
                        results.append(result)
        finally:
            for folder in filter(None, sources.values()):
                subprocess.run(["git", "worktree", "remove", "--force", str(folder)], check=False)
    command = "python -m tools.engine_counts " + " ".join(argv if argv is not None else sys.argv[1:])
    after = revision(args.after) if args.after else "this working tree"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(results, revision(args.before), after, command), encoding="utf-8")


if __name__ == "__main__":
    main()
