"""Reference token ids of Fast-dLLM's own samplers on the LLaDA and Dream stand-ins.

    # 1) build the stand-ins with the toolkit's environment
    python -m tools.standins --out /tmp/standins --only llada-8b-instruct dream-v0-instruct-7b
    # 2) run Fast-dLLM's code under the transformers 4.x it was written for (a separate environment:
    #    python -m venv env && env/bin/pip install torch==2.13.0 transformers==4.49.0 einops)
    env/bin/python tools/golden_fastdllm.py --standins /tmp/standins --fast-dllm DIR \\
        --out tests/standins/golden/fastdllm.json

``DIR`` is a checkout of NVlabs/Fast-dLLM (v1, the snapshot the toolkit follows is 24cc59e; not part
of this repository): its ``llada/`` folder (``generate.py`` and ``model/``) and its ``dream/model/``
folder. This script imports nothing from the toolkit, so that it runs in that other environment.

It loads each stand-in with Fast-dLLM's own model class (``LLaDAModelLM``; ``DreamModel``, whose
sampler is swapped for the cached one where a case uses a cache, as Fast-dLLM's Dream evaluation
does), float32, and decodes greedily three prompts of different lengths under twelve settings per
family: no cache, prefix cache and dual cache, each with threshold 0.9, with a threshold low enough
for the near-uniform stand-ins to unmask several tokens in one step (the script fails if no case of
the setting did), with threshold 0 (every step unmasks all it may: a block's full pass finishes it,
or, for Dream without a cache, the cap on tokens a step binds) and with a fixed number of steps. It
writes one JSON file: per case the settings as the toolkit's config fields, the sampler that ran,
the prompt, the whole response (``gen_length`` ids, uncut) and the number of model calls; per
family the stand-in's weight fingerprint and the prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_logits import weights_fingerprint  # noqa: E402  (a sibling script, as this one imports nothing else)

FAMILIES = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b"}
GEN_LENGTH = 16
BLOCK_LENGTH = 8
# prompts of three lengths, starting as the families' chat prompts do (LLaDA: <|startoftext|><|start_header_id|>;
# Dream: <|im_start|>), then ordinary BPE ids
PROMPTS = {
    "llada": [[126080, 126346, 3838, 126347],
              [126080, 126346, 872, 126347, 198, 3838, 374, 220, 16],
              [126080, 126346, 872, 126347, 198, 3838, 374, 220, 16, 17, 488, 220, 22, 30, 126348, 126346]],
    "dream": [[151644, 872, 198, 3838],
              [151644, 872, 198, 3838, 374, 220, 16, 17, 488],
              [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 3838, 30]],
}
# a threshold at which some steps of the near-uniform stand-ins unmask several tokens and others one (the top
# probabilities are about 6 times 1 / vocabulary size for LLaDA's, about 150 times for Dream's)
LOW_THRESHOLD = {"llada": 5.2e-5, "dream": 1e-3}
DREAM_CAP_STEPS = 4  # Dream's threshold without a cache: at most gen_length / 4 tokens a step (cumulated)
FIXED_STEPS = 8  # the fixed-steps settings: 2 tokens a step (LLaDA's even schedule; Dream's timesteps vary)


def settings(family: str) -> list[dict]:
    """The twelve settings of one family, as the toolkit's config fields (plus the name of each)."""
    low = LOW_THRESHOLD[family]
    blocks = GEN_LENGTH // BLOCK_LENGTH
    chosen = []
    for cache in ("none", "prefix", "dual"):
        for mode, threshold in (("threshold-0.9", 0.9), ("threshold-low", low), ("threshold-0", 0.0), ("fixed", None)):
            fields = {"gen_length": GEN_LENGTH, "use_cache": cache != "none", "dual_cache": cache == "dual",
                      "threshold": threshold}
            if family == "llada":
                fields.update(block_length=BLOCK_LENGTH, steps=blocks if threshold is not None else FIXED_STEPS)
            else:  # Dream: without a cache Fast-dLLM decodes one block; its threshold caps tokens by steps
                threshold_steps = blocks if cache != "none" else DREAM_CAP_STEPS
                fields.update(block_length=None if cache == "none" else BLOCK_LENGTH,
                              steps=FIXED_STEPS if threshold is None else threshold_steps,
                              alg="entropy" if threshold is None else "maskgit_plus", temperature=0.0, top_p=None)
            chosen.append({"name": f"{cache}/{mode}", **fields})
    return chosen


def count_calls(model: torch.nn.Module) -> list[int]:
    """A one-element list counting every later forward of ``model``."""
    counter = [0]

    def hook(module, args, kwargs):
        counter[0] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return counter


def import_from(folder: Path) -> None:
    """Make ``folder`` the first place imports look, forgetting a ``model`` package imported from elsewhere
    (Fast-dLLM's llada/ and dream/ folders both name theirs ``model``)."""
    for name in [name for name in sys.modules if name == "model" or name.startswith("model.")]:
        del sys.modules[name]
    sys.path.insert(0, str(folder))


def run_llada(code: Path, standin: Path) -> tuple[list[dict], str]:
    import_from(code / "llada")
    import generate as fast  # Fast-dLLM's llada/generate.py (it imports model.modeling_llada)
    from model.modeling_llada import LLaDAModelLM

    model = LLaDAModelLM.from_pretrained(str(standin), torch_dtype=torch.float32).eval()
    calls = count_calls(model)
    samplers = {"none": fast.generate, "prefix": fast.generate_with_prefix_cache, "dual": fast.generate_with_dual_cache}
    cases = []
    for setting in settings("llada"):
        sampler = samplers[setting["name"].split("/")[0]]
        for index, prompt in enumerate(PROMPTS["llada"]):
            calls[0] = 0
            ids = torch.tensor([prompt])
            out, nfe = sampler(model, ids, steps=setting["steps"], gen_length=setting["gen_length"],
                               block_length=setting["block_length"], temperature=0.0, remasking="low_confidence",
                               mask_id=model.config.mask_token_id, threshold=setting["threshold"])
            assert nfe == calls[0], (nfe, calls[0])
            cases.append(case_record(setting, f"generate.{sampler.__name__}", index, prompt,
                                     out[0, len(prompt):].tolist(), calls[0], model.config.mask_token_id))
    return cases, type(model).__name__


def run_dream(code: Path, standin: Path) -> tuple[list[dict], str]:
    import_from(code / "dream")
    from model import generation_utils, generation_utils_block
    from model.modeling_dream import DreamModel

    model = DreamModel.from_pretrained(str(standin), torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    calls = count_calls(model)
    cases = []
    for setting in settings("dream"):
        cached = setting["use_cache"]
        module = generation_utils_block if cached else generation_utils  # as Fast-dLLM's dream/eval.py swaps them
        model.diffusion_generate = types.MethodType(module.DreamGenerationMixin.diffusion_generate, model)
        model._sample = types.MethodType(module.DreamGenerationMixin._sample, model)
        alg = "confidence_threshold" if setting["threshold"] is not None else setting["alg"]
        extra = {"block_length": setting["block_length"], "dual_cache": setting["dual_cache"]} if cached else {}
        for index, prompt in enumerate(PROMPTS["dream"]):
            calls[0] = 0
            out = model.diffusion_generate(torch.tensor([prompt]), max_new_tokens=setting["gen_length"],
                                           steps=setting["steps"], temperature=0.0, top_p=None, top_k=None, alg=alg,
                                           alg_temp=0.0, threshold=setting["threshold"], output_history=False,
                                           return_dict_in_generate=True, **extra)
            cases.append(case_record(setting, f"{module.__name__.split('.')[-1]}._sample (alg={alg})", index, prompt,
                                     out.sequences[0, len(prompt):].tolist(), calls[0], model.config.mask_token_id))
    return cases, type(model).__name__


def case_record(setting: dict, sampler: str, index: int, prompt: list[int], tokens: list[int], calls: int,
                mask_token_id: int) -> dict:
    if mask_token_id in tokens:
        sys.exit(f"error: {setting['name']} prompt {index}: the response still holds the mask token")
    return {"setting": setting["name"], "config": {k: v for k, v in setting.items() if k != "name"},
            "sampler": sampler, "prompt": index, "tokens": tokens, "model_calls": calls}


def fewest_calls(config: dict) -> int:
    """The fewest model calls a threshold setting can take: one a block, two with a cache (its full pass
    and a cached step), and, for Dream without a cache, ``steps`` (the most it unmasks is masks / steps a step)."""
    blocks = config["gen_length"] // (config["block_length"] or config["gen_length"])
    if config["use_cache"]:
        return 2 * blocks
    return config["steps"] if "alg" in config else blocks


def check_parallel(cases: list[dict]) -> None:
    """Each low-threshold setting, over its prompts, took fewer calls than tokens in some case (so some step
    unmasked several tokens) and more than the fewest it could take in some case (so not every step unmasked
    all it could)."""
    for setting in sorted({case["setting"] for case in cases if case["setting"].endswith("threshold-low")}):
        runs = [case for case in cases if case["setting"] == setting]
        if min(case["model_calls"] for case in runs) >= GEN_LENGTH:
            sys.exit(f"error: {setting}: no step unmasked several tokens; lower LOW_THRESHOLD")
        if max(case["model_calls"] - fewest_calls(case["config"]) for case in runs) <= 0:
            sys.exit(f"error: {setting}: every step unmasked all it could; raise LOW_THRESHOLD")


def to_json(value: object, indent: str = "") -> str:
    """JSON with one line per case and per list of numbers (the file stays short and diffs stay readable)."""
    if isinstance(value, dict) and not all(isinstance(item, (int, float, str, bool, type(None)))
                                          for item in value.values()):
        inner = indent + " "
        items = [f"{inner}{json.dumps(key)}: {to_json(item, inner)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        inner = indent + " "
        return "[\n" + ",\n".join(inner + to_json(item, inner) for item in value) + "\n" + indent + "]"
    return json.dumps(value, separators=(", ", ": "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fast-dLLM's token ids on the LLaDA and Dream stand-ins")
    parser.add_argument("--standins", required=True, type=Path, help="the folder tools.standins wrote")
    parser.add_argument("--fast-dllm", required=True, type=Path, help="a checkout of NVlabs/Fast-dLLM")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    import transformers

    record = {"transformers": transformers.__version__, "torch": torch.__version__, "gen_length": GEN_LENGTH,
              "families": {}}
    for family, run in (("llada", run_llada), ("dream", run_dream)):
        standin = args.standins / FAMILIES[family]
        if not (standin / "config.json").is_file():
            sys.exit(f"error: no stand-in at {standin}; build it with python -m tools.standins first")
        with torch.no_grad():
            cases, model_class = run(args.fast_dllm, standin)
        check_parallel(cases)
        record["families"][family] = {"weights_sha256": weights_fingerprint(standin), "model_class": model_class,
                                      "prompts": PROMPTS[family], "cases": cases}
        print(f"{family}: {len(cases)} cases, model calls {[case['model_calls'] for case in cases]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(record) + "\n")


if __name__ == "__main__":
    main()
