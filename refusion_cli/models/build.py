"""Rebuild the embedded tiny models: the paper's controlled comparison in miniature.

    python -m refusion_cli.models.build            # or: make models

1) data       the synthetic GSM8K-format task: train split (not committed) and the held-out test
              split (committed as evals/synthetic/test.jsonl; rebuilt identically here)
2) tokenizer  a small byte-level BPE with Qwen3's special tokens and chat template
3) base-tiny  a Qwen3 pretrained from scratch with the AR objective on the train split
4) fine-tune  three copies of base-tiny on the same data, steps and batch: ``ar-tiny`` (AR),
              ``mdm-tiny`` (LLaDA objective, bidirectional), ``refusion-tiny`` (ReFusion objective)
5) export     the three fine-tuned models into refusion_cli/assets/<name>/ (safetensors), and the
              model card with loss curves into results/models/

Every stage is skipped when its output is complete and resumed when it was interrupted, so the
command can simply be run again. Each training stage runs ``refusion train`` in a subprocess and
logs to <work>/<stage>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from refusion_cli.models.loading import ASSETS

REPO = Path(__file__).resolve().parents[2]
FINETUNES = {"ar-tiny": "ar", "mdm-tiny": "llada", "refusion-tiny": "refusion"}
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


def train_command(output: Path, data: Path, objective: str, steps: int, batch: int, lr: float, seed: int,
                  source: list[str]) -> list[str]:
    return [sys.executable, "-m", "refusion_cli", "train", "--data", str(data), "--output", str(output),
            *source, "--objective", objective, "--steps", str(steps), "--batch-size", str(batch),
            "--lr", str(lr), "--max-length", "256", "--save-every", "200",
            "--seed", str(seed), "--warmup-ratio", "0.05"]


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Rebuild the embedded tiny models (ar-tiny, mdm-tiny, refusion-tiny).")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "models", help="scratch directory")
    parser.add_argument("--n-train", type=int, default=50000)
    parser.add_argument("--base-steps", type=int, default=2000)
    parser.add_argument("--finetune-steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--base-lr", type=float, default=2e-3)
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--model-config", default='{"intermediate_size": 512}',
                        help="JSON overrides of the 'tiny' Qwen3 config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="fine-tunes to run (default: all three)")
    parser.add_argument("--parallel", action="store_true",
                        help="run the three fine-tunes side by side, one thread each (faster on a 2-core CPU)")
    args = parser.parse_args(argv)

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
    run_stages({"base-tiny": train_command(work / "base-tiny", train_path, "ar", args.base_steps, args.batch_size,
                                           args.base_lr, args.seed, source)}, work, threads=None)
    # 4) the three fine-tunes: same data order, steps and batch; side by side, one thread each
    finetunes = {name: train_command(work / name, train_path, objective, args.finetune_steps, args.batch_size,
                                     args.finetune_lr, args.seed + 1, ["--model", str(work / "base-tiny")])
                 for name, objective in FINETUNES.items() if args.only is None or name in args.only}
    if args.parallel:
        run_stages(finetunes, work, threads=1)
    else:
        for name, command in finetunes.items():
            run_stages({name: command}, work, threads=None)
    # 5) export
    sizes = {name: export(work / name, name) for name in FINETUNES if (work / name / "model.safetensors").is_file()}
    print("exported:", ", ".join(f"{n} ({s / 1e6:.1f} MB)" for n, s in sizes.items()))


if __name__ == "__main__":
    main()
