"""Reference logits and token ids of the LLaDA and Dream stand-ins, made with their authors' code.

    # 1) build the stand-ins with the toolkit's environment
    python -m tools.standins --out /tmp/standins --only llada-8b-instruct dream-v0-instruct-7b
    # 2) run the authors' modelling code under the transformers 4.x it was written for (a separate
    #    environment: python -m venv env && env/bin/pip install torch==2.13.0 transformers==4.52.4)
    env/bin/python tools/golden_logits.py --standins /tmp/standins \\
        --llada-code DIR_WITH_configuration_llada.py_AND_modeling_llada.py \\
        --dream-code DIR_WITH_configuration_dream.py_modeling_dream.py_tokenization_dream.py \\
        --out tests/standins/golden

The code folders hold the ``*.py`` files published with ``GSAI-ML/LLaDA-8B-Instruct`` and
``Dream-org/Dream-v0-Instruct-7B`` (public copies: NVlabs/Fast-dLLM ``llada/model/`` for LLaDA, which
needs ``einops``; a copy of the hub folder for Dream; neither is part of this repository). This script
imports nothing from the toolkit, so that it runs in that other environment.

For each family it writes ``<family>.safetensors``: for every case (a single prompt, a shorter
one, and a left-padded batch of two) the input ids, the 2-D padding mask, the position ids the
authors' code uses, the float32 logits at a few vocabulary columns for every position, and over the
whole vocabulary the argmax and log-sum-exp of every position; and ``<family>.json``: the token ids
the authors' tokenizer gives for a few texts and chat prompts, and a fingerprint of the weights the
logits were made from (the test checks that it rebuilt the same stand-in).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FAMILIES = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b"}
TEXTS = ["What is 12 + 7?", "def add(a, b):\n    return a + b\n", "Ünïcödé — 数学 🙂  spaces\t\ttab",
         "<|im_start|>user\nhi<|im_end|>", "<|mask|><|mdm_mask|><|eot_id|> tail"]
CHATS = [[{"role": "user", "content": "What is 12 + 7?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
          {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"}]]
COLUMNS = 12  # vocabulary columns kept per position (the special ids, then evenly spread ones)


def weights_fingerprint(directory: Path) -> str:
    """sha256 over every weight's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def cases(config: dict, family: str) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """name -> (input ids [B][T], padding mask [B][T]); left padding as both authors' samplers pad."""
    mask, pad = config["mask_token_id"], config["pad_token_id"]
    special = 126346 if family == "llada" else 151644  # <|start_header_id|> / <|im_start|>
    prompt = [special, 872, 198, 3838, 374, 220, 16, 17, 488, 220]
    longer = prompt + [mask] * 6
    shorter = [special, 9707, 11, 1879, 0] + [mask] * 4
    padded = [pad] * (len(longer) - len(shorter)) + shorter
    return {
        "single": ([longer], [[1] * len(longer)]),
        "short": ([shorter], [[1] * len(shorter)]),
        "padded_batch": ([longer, padded], [[1] * len(longer), [0] * (len(longer) - len(shorter)) + [1] * len(shorter)]),
    }


def columns(config: dict, vocab: int) -> list[int]:
    chosen = [config["mask_token_id"], config["eos_token_id"], config["pad_token_id"]]
    step = vocab // (COLUMNS - len(chosen) + 1)
    chosen += [step * (i + 1) for i in range(COLUMNS - len(chosen))]
    return sorted(set(chosen))


def run_case(model, family: str, ids: torch.Tensor, padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, T, V], position ids [B, T]): every row's real tokens at positions 0..n-1, pads seen by no one.

    Dream's sampler pads a batch on the left and passes exactly that (a 4-D mask and position ids). LLaDA's
    code has no such path: its releases either ignore the padding mask (the hub's before 2025-10) or add it to a
    causal bias (Fast-dLLM's copy), so a padded row is not the row alone; there each row runs alone, unpadded,
    which is what a padded row must reproduce (its logits go at its real positions; pads get NaN)."""
    positions = padding.long().cumsum(-1) - 1
    positions.masked_fill_(padding == 0, 1)
    if not bool((padding == 0).any()):
        return (model(ids).logits if family == "llada" else model(ids, "full", None).logits), positions
    if family == "dream":
        mask = torch.logical_and(padding.bool().unsqueeze(1).unsqueeze(-2), padding.bool().unsqueeze(1).unsqueeze(-1))
        return model(ids, mask, positions).logits, positions
    logits = None
    for row in range(ids.shape[0]):
        real = padding[row].bool()
        alone = model(ids[row, real][None]).logits[0]  # [n, V]
        if logits is None:
            logits = torch.full((*ids.shape, alone.shape[-1]), float("nan"))
        logits[row, real] = alone
    return logits, positions


def golden(family: str, standin: Path, code: Path, out: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder) / FAMILIES[family]
        shutil.copytree(standin, work)
        for source in code.glob("*.py"):
            shutil.copy(source, work / source.name)
        model = AutoModel.from_pretrained(str(work), trust_remote_code=True, torch_dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(work), trust_remote_code=True)
        config = json.loads((work / "config.json").read_text())
        vocab = model.get_input_embeddings().weight.shape[0]
        kept = columns(config, vocab)
        tensors = {"columns": torch.tensor(kept)}
        for name, (rows, pads) in cases(config, family).items():
            ids, padding = torch.tensor(rows), torch.tensor(pads)
            with torch.no_grad():
                logits, positions = run_case(model, family, ids, padding)
            logits = logits.float()
            tensors.update({f"{name}.input_ids": ids, f"{name}.padding": padding, f"{name}.position_ids": positions,
                            f"{name}.logits": logits[..., kept].contiguous(), f"{name}.argmax": logits.argmax(-1),
                            f"{name}.logsumexp": torch.logsumexp(logits, -1)})
        save_file(tensors, str(out / f"{family}.safetensors"))
        ids = {"texts": {text: tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS},
               "chats": [tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
                         for chat in CHATS],
               "tokenizer_class": type(tokenizer).__name__, "model_class": type(model).__name__}
    import transformers

    record = {"weights_sha256": weights_fingerprint(standin), "transformers": transformers.__version__,
              "torch": torch.__version__, **ids}
    (out / f"{family}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"{family}: {out / (family + '.safetensors')} ({record['model_class']}, {record['tokenizer_class']})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="golden logits of the LLaDA and Dream stand-ins (authors' code)")
    parser.add_argument("--standins", required=True, type=Path, help="the folder tools.standins wrote")
    parser.add_argument("--llada-code", required=True, type=Path)
    parser.add_argument("--dream-code", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for family, code in (("llada", args.llada_code), ("dream", args.dream_code)):
        standin = args.standins / FAMILIES[family]
        if not (standin / "config.json").is_file():
            sys.exit(f"error: no stand-in at {standin}; build it with python -m tools.standins first")
        golden(family, standin, code, args.out)


if __name__ == "__main__":
    main()
