"""Reference decodes of D2F's decoder on the LLaDA and Dream stand-ins with their LoRA adapters, made with
D2F's own code (zhijie-group/Discrete-Diffusion-Forcing, its ``D2F-eval`` folder).

    # 1) the stand-ins and their adapters, with the toolkit's environment
    python -m tools.standins --out /tmp/standins --only d2f-llada-lora d2f-dream-lora
    # 2) D2F's code under its own pins (transformers 4.49.0, peft 0.17.0; its eval scripts import
    #    lm_eval 0.4.8 at the top): a separate environment
    env/bin/python tools/golden_d2f.py --standins /tmp/standins --d2f-eval DIR/D2F-eval \\
        --out tests/standins/golden/d2f.json

``DIR/D2F-eval`` is D2F's evaluation folder (``eval_llada.py``, ``eval_dream.py`` and ``model_cache/``); it is
not part of this repository. This script imports nothing from the toolkit, so that it runs in that other
environment. Each family's base loads with D2F's own model class (``model_cache/llada``,
``model_cache/dream``), its stand-in adapter with ``PeftModel.from_pretrained`` (unmerged), in float32; every
case then runs D2F's ``_generate_block_single`` from its module, greedy, on a small object that carries the
attributes the method reads (constructing D2F's evaluation class would also set up accelerate and load the
model by its own paths and dtype handling; the method itself is D2F's, unchanged).

The stand-ins' probabilities are nearly flat (a 126k / 152k vocabulary over 16-wide random weights): the
gsm8k settings commit one token a step (the forced commit of a complete block); the ``parallel`` cases use
skip thresholds inside the stand-ins' range of top probabilities, so that several blocks decode at once,
several tokens go in one step and finished blocks wait for earlier ones. The Dream ``eos`` case makes a token
the stand-in often predicts the tokenizer's EOS (Dream's code reads ``tokenizer.eos_token_id``; LLaDA's fixes
126081, which the stand-in never predicts), so that an EOS stops new blocks.

For each case the JSON holds the settings, and per prompt the whole response D2F leaves (every position of
every block it added, EOS or not), the response offsets each model call's step committed (derived from the
masks the calls were fed), the number of positions each call cached, and a fingerprint of the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_logits import weights_fingerprint  # noqa: E402  (a sibling script, as this one imports nothing else)

FAMILIES = {  # family -> (base stand-in, adapter stand-in, mask id, EOS id)
    "llada": ("llada-8b-instruct", "d2f-llada-lora", 126336, 126081),
    "dream": ("dream-v0-instruct-7b", "d2f-dream-lora", 151666, 151643),
}
PROMPTS = {  # three prompts of different lengths (chat-like special ids, then ordinary ones)
    "llada": [[126080, 126346, 882, 126347, 198], [126080, 126346, 882, 126347, 198, 3838, 374, 220, 16],
              [126080, 126346, 882, 126347, 198, 44, 6119, 702, 220, 16, 17, 40676, 13, 126348]],
    "dream": [[151644, 872, 198, 9707, 151645], [151644, 872, 198, 3838, 374, 220, 16, 17, 30],
              [151644, 872, 198, 44, 6119, 702, 220, 16, 17, 40676, 13, 151645, 198, 151644]],
}
# name, family, settings (the eval class's attribute names), the EOS id the tokenizer reports (None: the family's)
CASES = [
    ("gsm8k", "llada", {"max_new_tokens": 128, "block_size": 64, "block_add_threshold": 0.7,
                        "decoded_token_threshold": 0.95, "skip_threshold": 0.9}, None),
    ("parallel", "llada", {"max_new_tokens": 48, "block_size": 8, "block_add_threshold": 0.25,
                           "decoded_token_threshold": 0.5, "skip_threshold": 6.9e-5}, None),
    ("parallel-wide", "llada", {"max_new_tokens": 64, "block_size": 16, "block_add_threshold": 0.5,
                                "decoded_token_threshold": 0.75, "skip_threshold": 6.8e-5}, None),
    ("gsm8k", "dream", {"max_new_tokens": 96, "block_size": 32, "block_add_threshold": 0.1,
                        "decoded_token_threshold": 0.95, "skip_threshold": 0.9}, None),
    ("parallel", "dream", {"max_new_tokens": 48, "block_size": 8, "block_add_threshold": 0.25,
                           "decoded_token_threshold": 0.5, "skip_threshold": 8.5e-4}, None),
    ("eos", "dream", {"max_new_tokens": 64, "block_size": 8, "block_add_threshold": 0.25,
                      "decoded_token_threshold": 0.5, "skip_threshold": 8.5e-4}, 51814),
]
MAX_LENGTH = {"llada": 4096, "dream": 2048}  # the eval classes' defaults (the extent of their attention masks)


class FakeTokenizer:
    """What ``_generate_block_single`` asks of a tokenizer: the EOS, and a decode whose text is not used here."""

    eos_token = "<eos>"

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def decode(self, ids, **kwargs) -> str:
        return ""


def runner_class(module):
    """An object carrying D2F's own ``_generate_block_single`` and the helpers it calls, from ``module``."""
    evaluation = module.DreamLoRA

    class Runner:
        _generate_block_single = evaluation._generate_block_single
        _update_block_completion_states = evaluation._update_block_completion_states
        if hasattr(evaluation, "_shift_logits"):
            _shift_logits = evaluation._shift_logits

        def _count_non_eos_tokens_before_truncation(self, sequence, prompt_length):  # Dream's: sees the whole x_t
            self.response = list(sequence[prompt_length:])
            return 0

    return Runner


def load(family: str, standins: Path):
    from peft import PeftModel

    base_name, adapter_name, _, _ = FAMILIES[family]
    base_dir, adapter_dir = standins / base_name, standins / adapter_name
    if family == "llada":
        from model_cache.llada.configuration_llada import LLaDAConfig
        from model_cache.llada.modeling_llada import LLaDAModelLM
        base = LLaDAModelLM.from_pretrained(str(base_dir), config=LLaDAConfig.from_pretrained(str(base_dir)),
                                            torch_dtype=torch.float32)
    else:
        from model_cache.dream.configuration_dream import DreamConfig
        from model_cache.dream.model_dream import DreamModel
        base = DreamModel.from_pretrained(str(base_dir), config=DreamConfig.from_pretrained(str(base_dir)),
                                          torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base.eval(), str(adapter_dir)).eval()


def decode(runner_type, model, family: str, settings: dict, eos: int, prompt: list[int]) -> dict:
    calls: list[tuple[int, list[int], int]] = []  # (cached positions, fed ids, update_kvcache) per model call

    def watch(module, args, kwargs):
        past = kwargs.get("past_key_values")
        cached = 0 if past is None else (past[0][0].shape[-2] if isinstance(past, (list, tuple)) else
                                         past.get_seq_length())
        calls.append((cached, (args[0] if args else kwargs["input_ids"])[0].tolist(), kwargs.get("update_kvcache")))

    runner = runner_type()
    _, _, mask_id, _ = FAMILIES[family]
    runner.model, runner.device, runner.target_dtype = model, torch.device("cpu"), torch.float32
    runner.mask_token_id, runner.max_length, runner.tokenizer = mask_id, MAX_LENGTH[family], FakeTokenizer(eos)
    runner.temperature, runner.top_p, runner.top_k, runner.sampling_strategy = 0.0, None, None, "default"
    for key, value in settings.items():
        setattr(runner, key, value)
    handle = model.register_forward_pre_hook(watch, with_kwargs=True)
    try:
        returned = runner._generate_block_single(torch.tensor([prompt]))
    finally:
        handle.remove()
    response = returned if family == "llada" else runner.response
    masks = [{cached + i for i, token in enumerate(ids) if token == mask_id} for cached, ids, _ in calls]
    steps = [sorted(position - len(prompt) for position in now - later)
             for now, later in zip(masks, masks[1:] + [set()])]
    # LLaDA's call takes update_kvcache counted from 0, Dream's from the cached positions
    kept = [(update or 0) - (cached if family == "llada" and update else 0) for cached, _, update in calls]
    return {"prompt": prompt, "response": response, "steps": steps, "cached": kept}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="golden D2F decodes of the stand-ins (D2F's own code)")
    parser.add_argument("--standins", required=True, type=Path, help="the folder tools.standins wrote")
    parser.add_argument("--d2f-eval", required=True, type=Path, help="D2F's D2F-eval folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    for family, (base, adapter, _, _) in FAMILIES.items():
        for name in (base, adapter):
            if not any((args.standins / name).glob("*.safetensors")):
                sys.exit(f"error: no stand-in at {args.standins / name}; build it with python -m tools.standins first")
    sys.path.insert(0, str(args.d2f_eval.resolve()))
    import eval_llada  # registers lm-eval model "dream_lora", as eval_dream does: one at a time
    from lm_eval.api.registry import MODEL_REGISTRY

    MODEL_REGISTRY.pop("dream_lora")
    import eval_dream

    torch.manual_seed(0)
    modules = {"llada": eval_llada, "dream": eval_dream}
    record: dict = {"families": {}, "cases": []}
    for family, (base, adapter, mask_id, eos_id) in FAMILIES.items():
        model = load(family, args.standins)
        record["families"][family] = {"mask_token_id": mask_id, "eos_token_id": eos_id,
                                      "base_sha256": weights_fingerprint(args.standins / base),
                                      "adapter_sha256": weights_fingerprint(args.standins / adapter),
                                      "model_class": type(model.get_base_model()).__name__}
        runner_type = runner_class(modules[family])
        for name, case_family, settings, eos in CASES:
            if case_family != family:
                continue
            runs = [decode(runner_type, model, family, settings, eos or eos_id, prompt) for prompt in PROMPTS[family]]
            record["cases"].append({"name": name, "family": family, "settings": settings,
                                    "eos_token_id": eos or eos_id, "runs": runs})
            steps = [len(run["steps"]) for run in runs]
            widest = max(len(offsets) for run in runs for offsets in run["steps"])
            print(f"{family} {name}: {steps} steps, at most {widest} tokens in one step")
    import peft
    import transformers

    record.update({"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
