"""Logits memory and seconds per model call of Table 1's nine rows, on stand-ins at their real vocabulary sizes.

    python -m tools.logits_memory --before REV --out results/logits-memory [--calls 48] [--prompt-lengths 150 700]
        [--only DECODER ...]

A decoder that asks the model for the logits of every fed position pays, per call and row, fed
positions × vocabulary words (126,464 for LLaDA, 152,064 for Dream) in the model's dtype, and the
float copies its sampler makes of them; most of those positions are never read. This measures, for
each of Table 1's rows (decoder and settings at a 512-token response; the checkpoint's stand-in,
``tools/standins.py``: the real vocabulary and layout, 2 layers 16 wide, so that the head dominates)
and each prompt length, over the first ``--calls`` model calls of a decode at batch 1 in bfloat16:

- logits per row per call: the bytes of the largest logits tensor the model's head made per row in the
  call or in the row's step after it (a call's own logits, divided by its rows; Dream computes the logits
  of more than ``mdm.LOGITS_CHUNK`` reads a chunk at a time after the call): the largest and the mean
  over the calls;
- peak memory per row: the peak resident set (Linux's VmHWM, reset once the model is loaded) above
  the resident set then, over a 2-call warm-up decode and the measured one (each up to the start of
  the call after its last, so that the last call's step runs too), in a process whose malloc
  returns every freed block above 64 KiB to the system (a fixed ``MALLOC_MMAP_THRESHOLD_``):
  everything the decode held at once (the logits, the sampler's copies and probabilities, the
  activations, the cache);
- seconds per call: the decode's wall time up to the end of its last measured call, over the calls;
  the fastest of ``--repeats`` decodes, in another process with the default allocator.

Each measurement runs in a fresh process. ``--before REV`` measures the decoders of revision REV too,
beside those of ``--after REV`` (default: this working tree); a revision is checked out with ``git
worktree`` into a temporary folder and imported from there. ``--only`` measures some decoders' rows and
keeps the other rows of the tables already in ``--out``, each with the commits it was measured at.
Prompts are random ids; no EOS ends a decode early. Run it alone: other processes on the cores change
the timings.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools import set_threads
from tools.standins import build_standin

GEN_LENGTH = 512  # Table 1's response budget
PROMPT_IDS = 100_000  # prompts draw from the first ids of every vocabulary (no special token among them)


@dataclass(frozen=True)
class Row:
    name: str  # Table 1's row
    decoder: str
    standin: str  # tools.standins' name of its checkpoint
    adapter: str | None = None  # tools.standins' name of its LoRA adapter


ROWS = (
    Row("Llama-3-8B-Instruct", "ar", "llama-3-8b-instruct"),
    Row("Qwen3-8B", "ar", "qwen3-8b"),
    Row("LLaDA-8B-Instruct", "llada", "llada-8b-instruct"),
    Row("LLaDA w/ Fast-dLLM", "llada-fast-dllm", "llada-8b-instruct"),
    Row("LLaDA w/ D2F", "llada-d2f", "llada-8b-instruct", "d2f-llada-lora"),
    Row("Dream-7B-Instruct", "dream", "dream-v0-instruct-7b"),
    Row("Dream w/ Fast-dLLM", "dream-fast-dllm", "dream-v0-instruct-7b"),
    Row("Dream w/ D2F", "dream-d2f", "dream-v0-instruct-7b", "d2f-dream-lora"),
    Row("ReFusion", "refusion", "refusion"),
)


class Enough(Exception):
    """Raised by the model's forward hook once the measured calls are done: the decode stops there."""


def memory_kib(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` (its peak since the last reset) in KiB, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM again from the current resident set (Linux: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(row: Row, prompt_length: int, calls: int, repeats: int, standins: Path) -> dict[str, Any]:
    """One decode's first ``calls`` model calls (see the module docstring); refusion_cli is imported here,
    after ``--source`` had its say in :func:`child`."""
    import torch

    from refusion_cli.decoding.registry import build_config, with_length
    from refusion_cli.decoding.engine import run_decoder
    from refusion_cli.models import load_model

    source = str(standins / row.standin) + (f"+{standins / row.adapter}" if row.adapter else "")
    loaded = load_model(source, "cpu", torch.bfloat16, require_mask=row.decoder != "ar")
    config = build_config(row.decoder, with_length(row.decoder, {"gen_length": GEN_LENGTH}))
    prompt = torch.randint(0, PROMPT_IDS, (prompt_length,), generator=torch.Generator().manual_seed(0)).tolist()
    logits_bytes: list[float] = []  # per call: the largest logits per row the head made in it and the step after it
    ends: list[float] = []
    limit = [2]  # calls of the warm-up decode, then of the measured one

    def call_starts(module, args, kwargs):
        if len(ends) == limit[0]:  # the last measured call and its step are done
            raise Enough
        logits_bytes.append(0.0)

    def call_ends(module, args, kwargs, out):
        ends.append(time.perf_counter())

    def head_made(module, args, out):  # [B, U, V] in a call, [n, V] in a row's step
        per_row = out.numel() * out.element_size() / (out.shape[0] if out.dim() == 3 else 1)
        logits_bytes[-1] = max(logits_bytes[-1], per_row)

    def decode() -> None:
        try:
            run_decoder(row.decoder, loaded.model, prompt, config, mask_token_id=loaded.mask_token_id,
                        eos_token_id=None, generator=torch.Generator().manual_seed(0))
        except Enough:
            return
        raise RuntimeError(f"{row.decoder} finished within {limit[0]} calls")

    handles = [loaded.model.register_forward_pre_hook(call_starts, with_kwargs=True),
               loaded.model.register_forward_hook(call_ends, with_kwargs=True),
               loaded.model.get_output_embeddings().register_forward_hook(head_made)]
    before = memory_kib("VmRSS")
    reset_peak()
    decode()  # warm-up (its memory counts: what it leaves in the heap, the measured decode reuses)
    limit[0] = calls
    seconds = []
    for _ in range(repeats):
        logits_bytes.clear(), ends.clear()
        start = time.perf_counter()
        decode()
        seconds.append(ends[-1] - start)
    peak = memory_kib("VmHWM")
    for handle in handles:
        handle.remove()
    return {"row": row.name, "decoder": row.decoder, "prompt_length": prompt_length, "calls": calls,
            "repeats": repeats,
            "vocabulary": loaded.model.get_input_embeddings().num_embeddings,
            "logits_mb_max": max(logits_bytes) / 2**20,
            "logits_mb_mean": sum(logits_bytes) / len(logits_bytes) / 2**20,
            "peak_mb": (peak - before) / 1024, "seconds_per_call": min(seconds) / calls}


def child(argv: list[str]) -> None:
    """One measurement in this process (the parent starts one process per measurement); prints its JSON."""
    parser = argparse.ArgumentParser(prog="python -m tools.logits_memory --child")
    parser.add_argument("--row", type=int, required=True)
    parser.add_argument("--prompt-length", type=int, required=True)
    parser.add_argument("--calls", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--standins", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--source", type=Path, help="import refusion_cli from this tree")
    args = parser.parse_args(argv)
    if args.source is not None:
        sys.path.insert(0, str(args.source))
    set_threads(parser, args.threads)
    print(json.dumps(measure(ROWS[args.row], args.prompt_length, args.calls, args.repeats, args.standins)))


# glibc's malloc raises its mmap threshold to the size of each large block freed, up to 32 MiB, and then keeps
# freed blocks below it in its heap: the resident set would count memory the decode no longer holds. A fixed
# threshold turns that off, so every block above it is returned to the system when freed.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def run_one(row: int, prompt_length: int, args: argparse.Namespace, standins: Path, source: Path | None) -> dict:
    """One measurement: memory from a process with a fixed mmap threshold (one decode), seconds from one
    with the default allocator (the fastest of ``--repeats`` decodes)."""
    command = [sys.executable, "-m", "tools.logits_memory", "--child", "--row", str(row), "--prompt-length",
               str(prompt_length), "--calls", str(args.calls), "--standins", str(standins), "--threads",
               str(args.threads)] + (["--source", str(source)] if source is not None else [])
    memory = _child_result(command + ["--repeats", "1"], {**os.environ, **FIXED_MMAP_THRESHOLD})
    timing = _child_result(command + ["--repeats", str(args.repeats)], dict(os.environ))
    return {**memory, "repeats": timing["repeats"], "seconds_per_call": timing["seconds_per_call"]}


def _child_result(command: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def build_standins(folder: Path) -> Path:
    for row in ROWS:
        for name in filter(None, (row.standin, row.adapter)):
            if not (folder / name).is_dir():
                build_standin(name, folder / name)
    return folder


def ratio(before: float, after: float) -> str:
    return f"{before / after:.1f}×" if after > 0 else "–"


FIELDS = ["revision", "commit", "row", "decoder", "prompt_length", "vocabulary", "calls", "repeats", "logits_mb_max",
          "logits_mb_mean", "peak_mb", "seconds_per_call"]


def kept_results(out: Path, measured: set[str]) -> list[dict]:
    """The results in ``out``'s table of the decoders not in ``measured`` (none without a table)."""
    table = out / "logits-memory.csv"
    if not table.is_file():
        return []
    with table.open(newline="") as handle:
        kept = [row for row in csv.DictReader(handle) if row["decoder"] not in measured]
    for row in kept:
        for field in FIELDS[4:]:
            row[field] = float(row[field]) if "." in row[field] else int(row[field])
    return kept


def in_table_order(results: list[dict]) -> list[dict]:
    """Table 1's row order, then prompt length, before then after."""
    rows = [row.name for row in ROWS]
    return sorted(results, key=lambda r: (rows.index(r["row"]), r["prompt_length"], r["revision"] != "before"))


def write_tables(out: Path, results: list[dict], command: str, before: str | None, after: str,
                 kept: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = FIELDS
    with (out / "logits-memory.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for result in results:
            writer.writerow({field: round(value, 4) if isinstance(value, float) else value
                             for field, value in result.items() if field in fields})
    calls, repeats = results[0]["calls"], results[0]["repeats"]
    lines = [f"# Logits memory per model call, Table 1's rows on stand-ins at their real vocabularies\n",
             f"`{command}`\n",
             f"Each decoder at its Table 1 settings (512-token response), batch 1, bfloat16, on the stand-in of its "
             f"checkpoint (`tools/standins.py`: real vocabulary and layout, 2 layers 16 wide), its first {calls} model "
             f"calls of a random prompt. **logits**: MiB of the largest logits tensor the model's head made per row "
             f"in a call or in the row's step after it (Dream computes the logits of more than 32 reads a chunk at a "
             f"time after the call), largest and mean over the calls. **peak**: the peak resident set (Linux VmHWM) "
             f"over a 2-call warm-up and the measured decode, each up to the start of the call after its last, above "
             f"the resident set of the loaded model, MiB per row, with malloc returning every "
             f"freed block above 64 KiB (`MALLOC_MMAP_THRESHOLD_=65536`): everything the decode held at once "
             f"(logits, the sampler's copies and probabilities, activations, cache). **s/call**: wall seconds of the "
             f"decode up to its last measured call, per call, the fastest of {repeats} decodes in another process "
             f"with the default allocator (the model is tiny, so the head and the sampler dominate; on the real "
             f"7-8B models the layers do). This command measured before `{before}`, after `{after}`"
             + (", the rows of the decoders it names; the other rows are kept from the earlier table, measured "
                "at the commits their row names." if kept else ".") + "\n"]
    by_key = {(r["revision"], r["row"], r["prompt_length"]): r for r in results}
    lines.append("| row | decoder | prompt | commits, before → after | logits max, before → after | "
                 "logits mean, before → after | peak, before → after | s/call, before → after |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for result in results:
        if result["revision"] != "after":
            continue
        old = by_key.get(("before", result["row"], result["prompt_length"]))
        cells = []
        for field, digits in (("logits_mb_max", 1), ("logits_mb_mean", 1), ("peak_mb", 0), ("seconds_per_call", 3)):
            new = result[field]
            cells.append(f"{old[field]:.{digits}f} → {new:.{digits}f} ({ratio(old[field], new)})" if old
                         else f"{new:.{digits}f}")
        commits = f"{old['commit']} → {result['commit']}" if old else result["commit"]
        lines.append(f"| {result['row']} | {result['decoder']} | {result['prompt_length']} | {commits} | "
                     + " | ".join(cells) + " |")
    (out / "logits-memory.md").write_text("\n".join(lines) + "\n")


def git_revision(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m tools.logits_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for logits-memory.md and .csv")
    parser.add_argument("--before", help="also measure the decoders of this git revision (e.g. HEAD~1)")
    parser.add_argument("--after", help="the git revision measured as 'after' (default: this working tree)")
    parser.add_argument("--calls", type=int, default=48, help="model calls measured per decode")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measured decodes per measurement (s/call: the fastest)")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[150, 700])
    parser.add_argument("--only", nargs="+", choices=[row.decoder for row in ROWS], help="these decoders' rows only")
    parser.add_argument("--standins", type=Path, help="stand-ins to reuse, built there when missing "
                                                       "(default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.calls < 3:
        parser.error(f"--calls must be at least 3, got {args.calls}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    set_threads(parser, args.threads)
    rows = [index for index, row in enumerate(ROWS) if args.only is None or row.decoder in args.only]
    before = git_revision(args.before) if args.before else None
    after = git_revision(args.after) if args.after else "this working tree"
    with tempfile.TemporaryDirectory() as scratch:
        standins = build_standins(args.standins or Path(scratch) / "standins")
        revisions = {"before": args.before, "after": args.after}
        sources = {name: Path(scratch) / name if rev else None for name, rev in revisions.items()
                   if rev or name == "after"}
        for name, folder in sources.items():
            if folder is not None:
                subprocess.run(["git", "worktree", "add", "--detach", str(folder), revisions[name]], check=True,
                               capture_output=True)
        try:
            results = []
            for index in rows:
                for prompt_length in args.prompt_lengths:
                    for name, source in sources.items():
                        commit = before if name == "before" else after
                        result = {"revision": name, "commit": commit,
                                  **run_one(index, prompt_length, args, standins, source)}
                        print(json.dumps(result), flush=True)
                        results.append(result)
        finally:
            for folder in filter(None, sources.values()):
                subprocess.run(["git", "worktree", "remove", "--force", str(folder)], check=False)
    command = "python -m tools.logits_memory " + " ".join(argv)
    kept = kept_results(args.out, set(args.only)) if args.only else []
    write_tables(args.out, in_table_order(results + kept), command, before, after, kept=bool(kept))


if __name__ == "__main__":
    main()
