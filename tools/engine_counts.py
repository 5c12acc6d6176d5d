"""What a batched decode costs besides the model's arithmetic, counted the same way on two revisions, for every
decoder: host syncs per engine step (and per model call), attention calls per layer per model call, the positions
the model computed and the K/V bytes the cache code copied per generated token, the engine steps and model calls.

    python -m tools.engine_counts --before REV [--after REV] --out results/bench-batch/counts.md \
        [--decoders refusion ar llada ...] [--batch-sizes 1 16] [--limit 48] [--masked-limit 16] \
        [--gen-length N] [--standins DIR] [--device cpu]

Each revision decodes the held-out synthetic prompts in a child process of its own, one per decoder and batch
size; ``--before`` / ``--after`` check the revision out with ``git worktree`` into a temporary folder and import
the library from there (no ``--after``: this working tree). The counter is this tree's
``refusion_cli/bench/counts.py``, loaded by its path into every child, so an older revision (which has no
such module) is counted by the same code. A line per child shows its counts and how long it took (the counted
decode, and the whole child with its imports and model load); nothing else is timed, and the counts do not
depend on the machine (one thread, float32), except where the library picks a path by device (``--device``:
the packed attention is the default on CUDA).

The decoders run at their default config on their model (``spec.default_config``), ``--gen-length`` replacing
the response length (and what follows it, LLaDA's and Dream's steps and blocks): refusion, ar, llada and
llada-fast-dllm on their embedded models; dream, dream-fast-dllm, llada-d2f and dream-d2f on the stand-ins of
their checkpoints (``tools/standins.py``: the real layouts and vocabularies, two layers 16 wide; D2F's LoRA
adapter on its base), built into ``--standins`` (default: a temporary folder). The causal decoders decode the
first ``--limit`` prompts, the masked-diffusion ones the first ``--masked-limit`` (LLaDA and Dream without a
cache compute the whole canvas at every step: slow on a CPU). Prompt i draws from a generator seeded i, so a
sampling decoder's answers compare across revisions too.

How each is counted, identically for every revision (``refusion_cli/bench/counts.py`` says it in full):

- host syncs: ``item``, ``tolist``, ``bool()`` / ``int()`` / ``float()`` / ``index()`` of a tensor, ``nonzero``
  and indexing with a boolean tensor (a ``TorchFunctionMode`` sees every torch call), per call of
  ``Engine.step`` (the method wrapped in the child) and per model call; on a GPU also the calls of
  ``torch.cuda.synchronize`` and of CUDA events' and streams' ``synchronize`` (shown when there are any);
- tensor ops per step: ATen ops (a ``TorchDispatchMode``; views apart) inside ``Engine.step`` and outside the
  model's calls, a tensor made from host values counted as its copy to the device: a GPU's kernel launches
  and copies of a step besides the model's;
- attention calls: calls of ``scaled_dot_product_attention`` and of flex attention, divided by the model's
  layers times its calls; attention that runs neither (eager) is named in the column instead;
- positions: the ``input_ids`` elements of every model call (a padded call counts its padding), per
  generated token;
- K/V bytes copied: bytes written into K/V-shaped tensors ([rows, kv heads, columns, head dim]; a ``cat``
  along the head dimension, rotary embedding's, is not a copy) less the K/V of the positions fed, per
  generated token;
- model calls: a forward pre-hook on the model; engine steps: the wrapped ``Engine.step``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COUNTS_FILE = REPO / "refusion_cli" / "bench" / "counts.py"
# decoders without an embedded model -> the stand-in (tools.standins) of the checkpoint they run on
STANDIN_MODELS = {"dream": "dream-v0-instruct-7b", "dream-fast-dllm": "dream-v0-instruct-7b",
                  "llada-d2f": "d2f-llada-lora", "dream-d2f": "d2f-dream-lora"}
DECODERS = ["refusion", "ar", "llada", "llada-fast-dllm", *STANDIN_MODELS]


def load_counts() -> ModuleType:
    """This tree's counter module, by its path: the library a child imports may be a revision without it."""
    spec = importlib.util.spec_from_file_location("refusion_counts", COUNTS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# the child: one decoder at one batch size, in one revision


def child(args: argparse.Namespace) -> None:
    """Decode and count in this process, the library imported from ``--source`` when given."""
    if args.source:
        sys.path.insert(0, args.source)
    import torch

    torch.set_num_threads(1)
    import refusion_cli

    library = Path(refusion_cli.__file__).resolve().parent
    if args.source and not library.is_relative_to(Path(args.source).resolve()):
        raise SystemExit(f"imported the library from {library}, not from {args.source}")
    counts_module = load_counts()
    from refusion_cli.bench.prompts import synthetic_prompts
    from refusion_cli.models.chat import user_prompt_ids
    from refusion_cli.models.loading import load_model
    try:
        from refusion_cli.decoding.engine import run_decoder
    except ImportError:  # a revision before the engine
        from refusion_cli.decoding.registry import run_decoder  # type: ignore[attr-defined,no-redef]

    loaded = load_model(args.model, device=args.device, dtype=torch.float32, require_mask=needs_mask(args.decoder))
    config = decoder_config(args.decoder, args.model, args.gen_length)
    prompts = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in synthetic_prompts(args.limit)]
    device = next(loaded.model.parameters()).device
    generators = [torch.Generator(device=device).manual_seed(index) for index in range(len(prompts))]
    started = time.perf_counter()
    engine: dict[str, Any] = {}
    if args.packed_attention:  # a revision whose engine takes the choice (an older one attends row by row)
        from refusion_cli.decoding.engine import Engine

        if "packed_attention" in inspect.signature(Engine).parameters:
            engine = {"engine": Engine(loaded.model, max_rows=args.batch_size, packed_attention=True)}
    with counts_module.counting(loaded.model) as counts, torch.no_grad():
        results = run_decoder(args.decoder, loaded.model, prompts, config, batch_size=args.batch_size,
                              generator=generators, mask_token_id=loaded.mask_token_id,
                              eos_token_id=loaded.stop_token_ids, **engine)
    tokens = sum(result.stats.tokens for result in results)
    positions, kv_copied = counts.per_token(tokens)
    print(json.dumps({
        "decoder": args.decoder, "batch_size": args.batch_size, "prompts": len(prompts), "tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1), "config": dataclasses.asdict(config),
        "counts": counts.as_dict(), "syncs_per_step": counts.syncs_per_step(), "ops_per_step": counts.ops_per_step(),
        "syncs_per_call": counts.syncs_per_call(), "attention": counts.attention_label(),
        "positions_per_token": positions, "kv_copied_per_token": kv_copied,
        "answers": [result.tokens for result in results]}))


def needs_mask(decoder: str) -> bool:
    from refusion_cli.decoding.registry import DECODERS as SPECS

    spec = SPECS.get(decoder)
    return spec.needs_mask if spec is not None else decoder != "ar"


def decoder_config(decoder: str, model: str, gen_length: int | None) -> Any:
    """The decoder's default config on ``model`` at ``gen_length`` (None: its own), as this revision makes it."""
    try:
        from refusion_cli.decoding.spec import default_config
    except ImportError:  # a revision before spec.default_config
        from refusion_cli.decoding.registry import build_config, with_length

        return build_config(decoder, with_length(decoder, {} if gen_length is None else {"gen_length": gen_length}))
    return default_config(decoder, model, gen_length)


# ---------------------------------------------------------------------------------------------
# the parent: every decoder, batch size and revision


def models(decoders: list[str], standins: Path) -> dict[str, str]:
    """decoder -> the model it decodes on: its embedded model, else its stand-in (built into ``standins``)."""
    from refusion_cli.decoding.registry import decoder_spec
    from tools.standins import build_standin

    chosen = {}
    for decoder in decoders:
        embedded = decoder_spec(decoder).default_model
        if embedded is not None:
            chosen[decoder] = embedded
            continue
        folder = (standins / STANDIN_MODELS[decoder]).resolve()
        if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
            build_standin(STANDIN_MODELS[decoder], folder)  # an adapter's base beside it, when missing
        chosen[decoder] = str(folder)
    return chosen


def limit_of(decoder: str, args: argparse.Namespace) -> int:
    from refusion_cli.decoding.registry import decoder_spec

    return args.masked_limit if decoder_spec(decoder).bidirectional else args.limit


def measure(source: Path | None, decoder: str, model: str, batch_size: int, limit: int,
            args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "tools.engine_counts", "--child", "--decoder", decoder, "--model", model,
               "--batch-size", str(batch_size), "--limit", str(limit), "--device", args.device]
    command += ["--gen-length", str(args.gen_length)] if args.gen_length else []
    command += ["--source", str(source)] if source else []
    command += ["--packed-attention"] if args.packed_attention else []
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "child_seconds": round(time.perf_counter() - started, 1)}


def pair(old: Any, new: Any, digits: int = 1) -> str:
    def shown(value: Any) -> str:
        if value is None:
            return "–"
        return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value

    return f"{shown(old)} → {shown(new)}"


def row_cells(old: dict, new: dict) -> list[str]:
    syncs = pair(old["syncs_per_step"], new["syncs_per_step"])
    device = (old["counts"]["device_syncs"], new["counts"]["device_syncs"])
    if any(device):
        syncs += f" (device syncs {device[0]:,} → {device[1]:,})"
    return [syncs, pair(old.get("ops_per_step"), new.get("ops_per_step")),
            pair(old["syncs_per_call"], new["syncs_per_call"]), pair(old["attention"], new["attention"]),
            pair(old["positions_per_token"], new["positions_per_token"]),
            pair(old["kv_copied_per_token"], new["kv_copied_per_token"]),
            pair(old["counts"]["engine_steps"], new["counts"]["engine_steps"]),
            pair(old["counts"]["model_calls"], new["counts"]["model_calls"]),
            "yes" if old["answers"] == new["answers"] else "no"]


def table(results: list[dict], before: str, after: str, command: str, chosen: dict[str, str]) -> str:
    lines = [f"# What the engine costs besides the model (before `{before}`, after `{after}`)", "",
             f"`{command}`", "",
             "Per decoder and batch size, counted, not timed (tools/engine_counts.py and "
             "refusion_cli/bench/counts.py say how): host syncs (points where a GPU run waits for the device) per "
             "engine step and per model call, attention calls per layer per model call, positions the model "
             "computed per generated token (padding included), tensor ops per engine step outside the model's calls "
             "(each a kernel launch or a copy on a GPU), K/V bytes the cache code copied per generated "
             "token, the engine steps and model calls; the answers of both revisions are compared. Each decoder "
             "runs at its default config on its model (below); batch N decodes the prompts at most N at a time.",
             "",
             "| decoder | batch | host syncs / step, before → after | tensor ops / step | host syncs / call | "
             "attention calls / layer / call | positions / token | K/V bytes copied / token | engine steps | "
             "model calls | same answers |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    pairs: dict[tuple[str, int], dict[str, dict]] = {}
    for result in results:
        pairs.setdefault((result["decoder"], result["batch_size"]), {})[result["revision"]] = result
    settings: dict[str, dict] = {}
    for (decoder, size), found in pairs.items():
        old, new = found["before"], found["after"]
        settings[decoder] = new
        batch = f"{size}" + (f" ({new['prompts']} prompts)" if new["prompts"] < size else "")
        lines.append(f"| {decoder} | {batch} | " + " | ".join(row_cells(old, new)) + " |")
    lines += ["", "Decoders (the after revision's config; the before revision's differs where its defaults do):", ""]
    for decoder, new in settings.items():
        config = " ".join(f"{key}={value}" for key, value in new["config"].items())
        lines.append(f"- {decoder} on {Path(chosen[decoder]).name}, the first {new['prompts']} prompts: `{config}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.engine_counts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the git revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--after", help="the git revision measured as 'after' (default: this working tree)")
    parser.add_argument("--decoders", nargs="+", default=DECODERS, choices=DECODERS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--limit", type=int, default=48, help="prompts of the causal decoders (refusion, ar)")
    parser.add_argument("--masked-limit", type=int, default=16, help="prompts of the masked-diffusion decoders")
    parser.add_argument("--gen-length", type=int, help="response length (default: each decoder's own)")
    parser.add_argument("--standins", type=Path, help="folder of the stand-ins (built there when missing; "
                                                      "default: a temporary folder)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--packed-attention", action="store_true",
                        help="one attention call per layer for all rows (the CUDA default) where the revision has it")
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
                                          check=True, cwd=REPO).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        chosen = models(args.decoders, args.standins or Path(scratch) / "standins")
        sources: dict[str, Path | None] = {"before": Path(scratch) / "before", "after": None}
        if args.after:
            sources["after"] = Path(scratch) / "after"
        for name, folder in sources.items():
            if folder is not None:
                subprocess.run(["git", "worktree", "add", "--detach", str(folder), getattr(args, name)],
                               check=True, capture_output=True, cwd=REPO)
        try:
            results = []
            for decoder in args.decoders:
                for size in args.batch_sizes:
                    for name, folder in sources.items():
                        result = {"revision": name, **measure(folder, decoder, chosen[decoder], size,
                                                              limit_of(decoder, args), args)}
                        shown = {k: v for k, v in result.items() if k not in ("answers", "config", "counts")}
                        print(json.dumps(shown), flush=True)
                        results.append(result)
        finally:
            for folder in filter(None, sources.values()):
                subprocess.run(["git", "worktree", "remove", "--force", str(folder)], check=False, cwd=REPO)
    command = "python -m tools.engine_counts " + " ".join(argv if argv is not None else sys.argv[1:])
    after = revision(args.after) if args.after else "this working tree"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(results, revision(args.before), after, command, chosen), encoding="utf-8")


if __name__ == "__main__":
    main()
