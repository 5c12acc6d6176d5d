"""The memory model of ``--batch-size auto`` (``refusion_cli/decoding/memory.py``) against measured peaks.

    python -m tools.memory_model [--measured results/logits-memory/logits-memory.csv] [--out results/logits-memory]

For each row of Table 1 and prompt length that ``tools/logits_memory.py`` measured (its ``after``
rows: the peak resident set of a batch-1 decode's first calls on the checkpoint's stand-in, bfloat16,
a 512-token response), the row the memory model predicts for the same decoder, settings, prompt length
and stand-in, and their ratio. The stand-ins are 2 layers 16 wide, so the logits and the sampler's
copies of them are nearly all a row holds; the K/V and activations terms matter on the real
checkpoints, which this machine cannot load. Writes ``memory-model.md``.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import torch

from tools.logits_memory import GEN_LENGTH, ROWS
from tools.standins import build_standin

TOLERANCE = 0.25


def predictions(measured: Path) -> list[dict]:
    from refusion_cli.decoding.memory import ModelSize
    from refusion_cli.decoding.registry import build_config, row_memory_bytes, with_length
    from refusion_cli.models import load_model

    with measured.open(newline="") as handle:
        after = [row for row in csv.DictReader(handle) if row["revision"] == "after"]
    names = {row.name: row for row in ROWS}
    sizes: dict[str, ModelSize] = {}
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for entry in after:
            row = names[entry["row"]]
            if row.standin not in sizes:
                path = build_standin(row.standin, Path(folder) / row.standin)
                sizes[row.standin] = ModelSize.of(load_model(str(path), "cpu", torch.bfloat16,
                                                             require_mask=row.decoder != "ar").model)
            config = build_config(row.decoder, with_length(row.decoder, {"gen_length": GEN_LENGTH}))
            predicted = row_memory_bytes(row.decoder, config, int(entry["prompt_length"]), sizes[row.standin]) / 2**20
            out.append({"row": row.name, "decoder": row.decoder, "prompt": int(entry["prompt_length"]),
                        "measured": float(entry["peak_mb"]), "predicted": predicted, "commit": entry["commit"]})
    return out


def write(out: Path, results: list[dict], command: str) -> None:
    lines = [
        "# The memory model of `--batch-size auto` against measured peaks", "",
        f"`{command}`", "",
        "**measured**: the peak resident set per row of a batch-1 decode on the checkpoint's stand-in "
        "(`logits-memory.csv`, its `after` rows, commit as listed), MiB. **predicted**: "
        "`refusion_cli/decoding/memory.py`'s row for the same decoder, settings (512-token response) and "
        "prompt, MiB. Within 25 %: |predicted / measured - 1| <= 0.25.", "",
        "| row | decoder | prompt | measured | predicted | predicted / measured | within 25 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["predicted"] / r["measured"]
        lines.append(f"| {r['row']} | {r['decoder']} | {r['prompt']} | {r['measured']:.1f} ({r['commit']}) | "
                     f"{r['predicted']:.1f} | {ratio:.2f} | {'yes' if abs(ratio - 1) <= TOLERANCE else 'no'} |")
    (out / "memory-model.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.memory_model", description=__doc__.split("\n")[0])
    parser.add_argument("--measured", type=Path, default=Path("results/logits-memory/logits-memory.csv"))
    parser.add_argument("--out", type=Path, default=Path("results/logits-memory"))
    args = parser.parse_args(argv)
    results = predictions(args.measured)
    write(args.out, results, "python -m tools.memory_model " + " ".join(argv if argv is not None else []))
    for r in results:
        print(f"{r['decoder']:16} {r['prompt']:4}  measured {r['measured']:8.1f}  predicted {r['predicted']:8.1f}")


if __name__ == "__main__":
    main()
