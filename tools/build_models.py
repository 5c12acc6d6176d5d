"""Rebuild the embedded tiny models: the paper's controlled comparison in miniature.

    python -m tools.build_models --threads 2     # or: make models

1) data       the synthetic GSM8K-format task: train split (not committed) and the held-out test
              split (committed as evals/synthetic/test.jsonl; rebuilt identically here)
2) tokenizer  a small byte-level BPE with Qwen3's special tokens and chat template
3) base-tiny  a Qwen3 pretrained from scratch with the AR objective on the train split
4) fine-tune  three copies of base-tiny on the same data, steps and batch: ``ar-tiny`` (AR),
              ``mdm-tiny`` (LLaDA objective, bidirectional), ``refusion-tiny`` (ReFusion objective);
              with ``--continue-steps N`` each is then trained N more steps (a second warmup + cosine
              schedule, a new data order) into <work>/<name>-cont, the same for all three
4c) dream     ``dream-tiny``: the finished ar-tiny fine-tuned with the dream objective (shifted masked
              diffusion, bidirectional), as Dream starts from a trained AR model; a chain of schedules
              (``--dream-stage``, each stage continuing the last, a new data order each); only when
              ``--only`` names it (it is not shipped yet)
5) export     the fine-tuned models into refusion_cli/assets/<name>/ (safetensors), and the
              model card with loss curves into results/models/

Every stage is skipped when its output is complete and resumed when it was interrupted, so the
command can simply be run again. Each training stage runs ``refusion train`` in a subprocess and
logs to <work>/<stage>.log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from refusion_cli.models.loading import ASSETS

REPO = Path(__file__).resolve().parents[1]
FINETUNES = {"ar-tiny": "ar", "mdm-tiny": "llada", "refusion-tiny": "refusion"}
DREAM = "dream-tiny"  # the Dream baseline: the finished ar-tiny fine-tuned with the dream objective, as Dream starts from an AR model
OBJECTIVE_OF = {**FINETUNES, DREAM: "dream"}
# dream-tiny's schedules, each continuing the last (steps, global batch, lr, warmup ratio): the recipe found on
# a 2-core CPU, one stage per session (results/models/logs/dream-tiny-attempt/README.md)
DREAM_STAGES = ((1000, 64, 1e-3, 0.05), (800, 128, 5e-4, 0.02), (2000, 128, 3e-4, 0.01))
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def stage_done(output: Path) -> bool:
    return (output / "model.safetensors").is_file() and (output / "trainer_state.json").is_file()


def start_stage(name: str, command: list[str], work: Path, threads: int | None) -> subprocess.Popen | None:
    """Start one training stage (resuming it if it has checkpoints); None when it is complete already."""
    output = Path(command[command.index("--output") + 1])
    if stage_done(output):
        print(f"[{name}] done already: {output}", flush=True)
        return None
    if any(output.glob("checkpoint-*")):
        command = command + ["--resume"]
    print(f"[{name}] {' '.join(command)}", flush=True)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    log = open(work / f"{name}.log", "a")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_stages(stages: dict[str, list[str]], work: Path, threads: int | None) -> None:
    """Run stages side by side and wait for all; record each one's wall time in <work>/<name>.time."""
    started = {name: (start_stage(name, command, work, threads), time.perf_counter())
               for name, command in stages.items()}
    for name, (process, start) in started.items():
        if process is None:
            continue
        if process.wait() != 0:
            sys.exit(f"[{name}] failed with exit code {process.returncode}; see {work / f'{name}.log'}")
        (work / f"{name}.time").write_text(json.dumps(time.perf_counter() - start))


def run_group(stages: dict[str, list[str]], work: Path, parallel: bool, threads: int | None) -> None:
    """Run a group of stages side by side (``parallel``; ``threads``, default 1, each), else one after the other."""
    if parallel:
        run_stages(stages, work, threads=threads or 1)
    else:
        for name, command in stages.items():
            run_stages({name: command}, work, threads=threads)


def train_command(output: Path, data: Path, objective: str, steps: int, batch: int, lr: float, seed: int,
                  source: list[str], extra: list[str] | None = None, warmup: float = 0.05) -> list[str]:
    return [sys.executable, "-m", "refusion_cli", "train", "--data", str(data), "--output", str(output),
            *source, "--objective", objective, "--steps", str(steps), "--batch-size", str(batch),
            "--lr", str(lr), "--max-length", "256", "--save-every", "200",
            "--seed", str(seed), "--warmup-ratio", str(warmup), *(extra or [])]


def dream_stage_names(count: int) -> list[str]:
    """The work folders of dream-tiny's stages: dream-tiny-1, dream-tiny-2, ... (the last one is exported)."""
    return [f"{DREAM}-{i}" for i in range(1, count + 1)]


def export(source: Path, name: str) -> int:
    """Copy a trained model's files into the package; returns the bytes written."""
    target = ASSETS / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    size = 0
    for file in EXPORT_FILES:
        if (source / file).is_file():
            shutil.copy2(source / file, target / file)
            size += (target / file).stat().st_size
    return size


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_card(work: Path, results: Path, settings: dict) -> None:
    """The model card: data, steps, tokens, time and final losses of every run, and the loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chains = {model: [run for run in runs if (work / run / "loss_log.jsonl").is_file()]
              for model, runs in model_runs(len(settings.get("dream_stage") or DREAM_STAGES)).items()}
    chains = {model: runs for model, runs in chains.items() if runs}
    results.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for model, runs in chains.items():
        axis = axes[0] if model == "base-tiny" else axes[1]
        log: list[dict] = []
        for run in runs:
            offset = log[-1]["step"] if log else 0
            if offset:
                axis.axvline(offset, color="grey", linestyle=":", linewidth=1)
            log += [dict(r, step=r["step"] + offset) for r in read_log(work / run / "loss_log.jsonl")]
        window = 20
        smooth = [sum(r["loss"] for r in log[max(0, i - window + 1):i + 1]) / len(log[max(0, i - window + 1):i + 1])
                  for i in range(len(log))]
        start = " from ar-tiny" if model == DREAM else ""
        axis.plot([r["step"] for r in log], smooth, label=f"{model} ({OBJECTIVE_OF.get(model, 'ar')} objective{start})")
    for axis, title in zip(axes, ("AR pretraining from scratch", "fine-tuning (dotted: the next schedule)")):
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("training loss (20-step mean)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(results / "loss_curves.png", dpi=120)
    rows = []
    for model, runs in chains.items():
        for run in runs:
            rows.append(card_row(work / run, OBJECTIVE_OF.get(model, "ar")))
            keep_records(work / run, results / "logs" / run)
    config = json.loads((work / "base-tiny" / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(work / "base-tiny" / "model.safetensors"), "pt") as weights:
        n_params = sum(_numel(weights.get_slice(key).get_shape()) for key in weights.keys())
    stop = settings.get("base_stop_at")
    stop_note = (f"ended at step {stop} of a {settings['base_steps']}-step schedule (`--stop-at {stop}`)" if stop
                 else f"{settings['base_steps']} steps")
    cont = settings.get("continue_steps")
    cont_note = (f"; then {cont} more steps from there (`<name>-cont` rows: the same lr, warmup and cosine "
                 f"again, a new data order); the shipped models are the `-cont` ones" if cont else "")
    text = f"""# Embedded models: model card

Three tiny Qwen3 models trained by `make models` (`python -m tools.build_models {settings['argv']}`),
the paper's controlled comparison (its Table 2) in miniature: one AR-pretrained base, fine-tuned three
times with the same data, steps, batch and data order, once per objective.

- **Architecture**: Qwen3, {config['num_hidden_layers']} layers, hidden size {config['hidden_size']},
  {config['num_attention_heads']} heads ({config['num_key_value_heads']} KV heads), MLP {config['intermediate_size']},
  vocabulary {config['vocab_size']}, tied embeddings; {n_params / 1e6:.2f} M parameters; float32 safetensors.
- **Tokenizer**: byte-level BPE trained on the training split (digits split one per token), with Qwen3's
  special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (EOS), `<|mask|>` and a Qwen3-style chat template.
- **Data**: the synthetic GSM8K-format task (`refusion_cli/tasks/synthetic.py`): {settings['n_train']:,} training problems
  (seed {settings['seed']}), never overlapping the 500 held-out problems in `evals/synthetic/test.jsonl`.
- **Schedule**: AdamW, warmup 5 % then cosine, max length 256. Pretraining: global batch {settings['batch_size']},
  lr {settings['base_lr']}, {stop_note}. Fine-tuning: global batch {settings.get('finetune_batch_size') or settings['batch_size']},
  lr {settings['finetune_lr']}, {settings['finetune_steps']} steps,
  a full cosine schedule each{cont_note}.
- **Objectives**: `ar-tiny` next-token CE; `mdm-tiny` LLaDA masked diffusion (bidirectional attention, responses padded
  with EOS to the longest one as in LLaDA's SFT, CE/p);
  `refusion-tiny` ReFusion's hybrid objective (slot size from {{4, 8, 16, 32}}, clean slots shuffled and scored
  autoregressively, masked slots scored with CE/p).

| run | objective | steps | batch | tokens seen | device, precision | training minutes (sum of step times) | final loss (mean of last 20 steps) | size (MB) |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Each run's per-step records (losses, lr, tokens, seconds: `loss_log.jsonl.gz`) and its `trainer_state.json`
(schedule, seed, data hash, device) are in `logs/<run>/`; the table is computed from them.

Step times depend on the device and on how many runs shared it (the fine-tunes run side by side with
`--parallel`), so the minutes are not comparable between rows. Losses of different objectives are not comparable with each other (the masked
parts are weighted by 1/p).

![loss curves](loss_curves.png)
"""
    (results / "README.md").write_text(text)


def model_runs(dream_stages: int) -> dict[str, list[str]]:
    """Each model's training runs (work folders), in order: a fine-tune, then its continuation."""
    return {"base-tiny": ["base-tiny"], **{name: [name, f"{name}-cont"] for name in FINETUNES},
            DREAM: dream_stage_names(dream_stages)}


def card_row(run: Path, objective: str) -> str:
    """One run's row of the model card's table, from its step log and trainer state."""
    log = read_log(run / "loss_log.jsonl")
    last = log[-20:]
    tokens = sum(r["tokens"] for r in log)
    seconds = sum(r["seconds"] for r in log)
    size = (run / "model.safetensors").stat().st_size / 1e6 if (run / "model.safetensors").exists() else 0
    state = json.loads((run / "trainer_state.json").read_text())
    where = state.get("device", "cpu (not recorded)")
    return (f"| {run.name} | {objective} | {log[-1]['step']} | {state['run']['batch_size']} | {tokens:,} | "
            f"{where} | {seconds / 60:.1f} | {sum(r['loss'] for r in last) / len(last):.4f} | {size:.1f} |")


def keep_records(run: Path, target: Path) -> None:
    """Copy a run's raw records next to the card: the step log gzipped (no name or time in the header,
    so a rebuild from the same log writes the same bytes) and the trainer state."""
    import gzip

    target.mkdir(parents=True, exist_ok=True)
    with open(target / "loss_log.jsonl.gz", "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw, mtime=0) as out:
        out.write((run / "loss_log.jsonl").read_bytes())
    shutil.copyfile(run / "trainer_state.json", target / "trainer_state.json")


def _numel(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Rebuild the embedded tiny models (ar-tiny, mdm-tiny, refusion-tiny).")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "models", help="scratch directory")
    parser.add_argument("--n-train", type=int, default=50000)
    parser.add_argument("--base-steps", type=int, default=2000, help="length of the pretraining LR schedule")
    parser.add_argument("--base-stop-at", type=int, default=600,
                        help="end pretraining at this step of the schedule (0: run the whole schedule)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of sequential stages")
    parser.add_argument("--finetune-steps", type=int, default=2000)
    parser.add_argument("--continue-steps", type=int, default=2800,
                        help="a second fine-tuning schedule of N steps from the first (0: none)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--finetune-batch-size", type=int, default=256,
                        help="global batch of the fine-tunes (0: --batch-size)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader processes of the fine-tunes")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                        help="precision of the fine-tunes (default: Accelerate's)")
    parser.add_argument("--base-lr", type=float, default=2e-3)
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--model-config", default='{"intermediate_size": 512}',
                        help="JSON overrides of the 'tiny' Qwen3 config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None,
                        help=f"models to train (default: the three fine-tunes); {DREAM}, the Dream baseline (not "
                             "shipped: not yet good enough), is trained only when named, and starts from ar-tiny, so "
                             "it needs ar-tiny among them")
    parser.add_argument("--dream-stage", nargs=4, action="append", default=None,
                        metavar=("STEPS", "BATCH", "LR", "WARMUP"),
                        help=f"one schedule of {DREAM}, continuing the one before; repeat for a chain (default: "
                             + ", ".join(f"{s} {b} {lr:g} {w:g}" for s, b, lr, w in DREAM_STAGES) + ")")
    parser.add_argument("--parallel", action="store_true",
                        help="run the three fine-tunes side by side, --threads (default 1) each: the way to share "
                             "one GPU; on 2 CPU cores it was measured slower than one after the other with "
                             "--threads 2 (~3 s/step each vs ~0.8 s/step)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse impossible values before the data, the tokenizer and the first training stage are built (a bad
    --steps or --lr would otherwise fail only inside a training subprocess, after minutes)."""
    at_least = {"n_train": 1, "base_steps": 1, "finetune_steps": 1, "batch_size": 1, "base_stop_at": 0,
                "continue_steps": 0, "finetune_batch_size": 0, "num_workers": 0}
    for name, low in at_least.items():
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.base_stop_at > args.base_steps:
        parser.error(f"--base-stop-at ({args.base_stop_at}) is past the end of --base-steps ({args.base_steps})")
    for name in ("base_lr", "finetune_lr"):
        if not 0 < getattr(args, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    args.dream_stage = [dream_stage(parser, stage) for stage in args.dream_stage] if args.dream_stage \
        else list(DREAM_STAGES)
    if args.model_config:
        try:
            overrides = json.loads(args.model_config)
        except json.JSONDecodeError as exc:
            parser.error(f"--model-config is not valid JSON: {exc.msg} (column {exc.colno})")
        if not isinstance(overrides, dict):
            parser.error("--model-config must be a JSON object of Qwen3Config fields")
    unknown = sorted(set(args.only or ()) - {*FINETUNES, DREAM})
    if unknown:
        parser.error(f"--only: unknown model(s) {', '.join(unknown)}; choose from {', '.join((*FINETUNES, DREAM))}")
    if args.only is not None and DREAM in args.only and "ar-tiny" not in args.only:
        parser.error(f"--only: {DREAM} starts from ar-tiny; add ar-tiny")
    if args.work.exists() and not args.work.is_dir():
        parser.error(f"--work {args.work} is a file, not a directory")


def dream_stage(parser: argparse.ArgumentParser, values: list[str]) -> tuple[int, int, float, float]:
    """One ``--dream-stage STEPS BATCH LR WARMUP``, checked: whole steps and batch >= 1, lr > 0, warmup in [0, 1)."""
    shown = " ".join(values)
    try:
        steps, batch, lr, warmup = int(values[0]), int(values[1]), float(values[2]), float(values[3])
    except ValueError:
        parser.error(f"--dream-stage {shown}: expected STEPS BATCH LR WARMUP, e.g. 800 128 5e-4 0.02")
    if steps < 1 or batch < 1 or not 0 < lr < math.inf or not 0 <= warmup < 1:
        parser.error(f"--dream-stage {shown}: steps and batch must be at least 1, lr a positive number and "
                     "warmup from 0 to below 1")
    return steps, batch, lr, warmup


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    from refusion_cli.tasks.synthetic import read_jsonl, write_splits
    from refusion_cli.tasks.tokenizer import corpus_texts, train_tokenizer

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    # 1) data
    train_path = work / "train.jsonl"
    if not train_path.is_file():
        write_splits(REPO / "evals" / "synthetic", args.n_train, 500, args.seed, train_path=train_path)
    # 2) tokenizer
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_tokenizer(corpus_texts(read_jsonl(train_path)), 512, tokenizer_dir)
    # 3) base-tiny, AR pretraining from scratch
    source = ["--init", "tiny", "--tokenizer", str(tokenizer_dir)]
    if args.model_config:
        source += ["--model-config", args.model_config]
    base = train_command(work / "base-tiny", train_path, "ar", args.base_steps, args.batch_size, args.base_lr,
                         args.seed, source)
    if args.base_stop_at:
        base += ["--stop-at", str(args.base_stop_at)]
    run_stages({"base-tiny": base}, work, threads=args.threads)
    # 4) the three fine-tunes: same data order, steps and batch
    batch = args.finetune_batch_size or args.batch_size
    extra = ["--num-workers", str(args.num_workers)]
    if args.mixed_precision:
        extra += ["--mixed-precision", args.mixed_precision]
    finetunes = {name: train_command(work / name, train_path, objective, args.finetune_steps, batch,
                                     args.finetune_lr, args.seed + 1, ["--model", str(work / "base-tiny")], extra)
                 for name, objective in FINETUNES.items() if args.only is None or name in args.only}
    run_group(finetunes, work, args.parallel, args.threads)
    # 4b) the continuation: N more steps for each, same settings again, a new data order
    final = {name: work / name for name in finetunes}
    if args.continue_steps:
        final = {name: work / f"{name}-cont" for name in finetunes}
        continued = {f"{name}-cont": train_command(final[name], train_path, FINETUNES[name], args.continue_steps,
                                                   batch, args.finetune_lr, args.seed + 2,
                                                   ["--model", str(work / name)], extra)
                     for name in finetunes}
        run_group(continued, work, args.parallel, args.threads)
    # 4c) dream-tiny: Dream starts from a trained AR model, so from the finished ar-tiny; one stage after the other
    if args.only is not None and DREAM in args.only:
        start = final["ar-tiny"]
        for i, (name, (steps, size, lr, warmup)) in enumerate(zip(dream_stage_names(len(args.dream_stage)),
                                                                    args.dream_stage)):
            stage = train_command(work / name, train_path, "dream", steps, size, lr, args.seed + 1 + i,
                                  ["--model", str(start)], extra, warmup=warmup)
            run_stages({name: stage}, work, threads=args.threads)
            start = work / name
        final[DREAM] = start
    # 5) export
    sizes = {name: export(path, name) for name, path in final.items() if (path / "model.safetensors").is_file()}
    print("exported:", ", ".join(f"{n} ({s / 1e6:.1f} MB)" for n, s in sizes.items()))
    # 6) model card
    settings = dict(vars(args), argv=" ".join(argv if argv is not None else sys.argv[1:]))
    write_card(work, REPO / "results" / "models", settings)


if __name__ == "__main__":
    main()
