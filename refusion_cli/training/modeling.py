"""The model to train: a checkpoint made ready for the objectives, or a fresh tiny Qwen3.

Either way the result carries a ``<|mask|>`` token, stored as ``config.mask_token_id``. A
tokenizer without one gets the reference train.py's two special tokens, ``<|beginoftext|>`` (unless
it has it) then ``<|mask|>``: on Qwen3's 151,669-token vocabulary they are 151669 and 151670, the
mask id the reference's generate.py hard-codes, so checkpoints move between the two unchanged. A
tokenizer that already has ``<|mask|>`` keeps it where it is. The embeddings are only ever grown,
never cut to the tokenizer's length (the reference cuts Qwen3's 151,936 padded rows to 151,671, so
its softmax has no logits for the unused ids; either size loads in both).
``config.is_causal`` records the attention the
objective trains (False for ``llada``), so the saved checkpoint loads with the right attention.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from huggingface_hub.errors import StrictDataclassError

from refusion_cli.errors import UserError
from refusion_cli.training.objectives import Objective
from refusion_cli.models.checkpoint import Checkpoint, Kind, kind_of, locate, resolve_checkpoint
from refusion_cli.models.loading import MASK_TOKEN, find_mask_id, load_model

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

# Named configs for --init; every field can be overridden with --model-config.
TINY_CONFIGS: dict[str, dict[str, int | float | bool]] = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
}
BEGIN_TOKEN = "<|beginoftext|>"  # the reference's train.py adds it, then MASK_TOKEN, to a tokenizer without a mask
TOKENIZER_FIELDS = ("eos_token_id", "pad_token_id", "mask_token_id")  # --init takes these from the tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a saved tokenizer directory has one of these
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")  # counts and widths: at least 1
SUPPORTED_ATTENTION = ("sdpa", "eager")  # the backends that take an explicit 4-D mask


@dataclass
class TrainableModel:
    model: torch.nn.Module  # float32, train mode, gradients on
    tokenizer: object
    mask_token_id: int
    pad_token_id: int


def parse_model_config(text: str | None) -> dict[str, object]:
    """--model-config: a JSON object of Qwen3Config fields; unknown fields are an error."""
    from transformers import Qwen3Config

    if not text:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--model-config is not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(overrides, dict):
        raise UserError('--model-config must be a JSON object, e.g. \'{"hidden_size": 128, "num_hidden_layers": 2}\'')
    reserved = sorted(set(overrides) & set(TOKENIZER_FIELDS))
    if reserved:
        raise UserError(f"--model-config: {', '.join(reserved)} come(s) from the tokenizer and cannot be set")
    unknown = sorted(set(overrides) - set(Qwen3Config().to_dict()))
    if unknown:
        raise UserError(f"--model-config: unknown Qwen3Config field(s): {', '.join(unknown)}",
                        hint="use field names of transformers.Qwen3Config, such as hidden_size or num_hidden_layers")
    check_model_fields(overrides)
    return overrides


def check_model_fields(fields: dict[str, object]) -> None:
    """Values Qwen3Config accepts but the model cannot be built (or run) with; types are Qwen3Config's to check."""
    from transformers.activations import ACT2FN

    for name in SIZE_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UserError(f"--model-config: {name} must be at least 1 (got {value})")
    eps, dropout = fields.get("rms_norm_eps"), fields.get("attention_dropout")
    if isinstance(eps, int | float) and not eps > 0:
        raise UserError(f"--model-config: rms_norm_eps must be positive (got {eps})")
    if isinstance(dropout, int | float) and not 0 <= dropout < 1:
        raise UserError(f"--model-config: attention_dropout must be in [0, 1) (got {dropout})")
    if "hidden_act" in fields and not (isinstance(fields["hidden_act"], str) and fields["hidden_act"] in ACT2FN):
        raise UserError(f"--model-config: unknown hidden_act {fields['hidden_act']!r}",
                        hint="use an activation of transformers.activations.ACT2FN, such as silu or gelu")
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads >= 1 and heads % kv_heads:
        raise UserError(f"--model-config: num_attention_heads ({heads}) must be a multiple of "
                        f"num_key_value_heads ({kv_heads})")


def ensure_mask_token(model: torch.nn.Module, tokenizer) -> int:
    """Add ``<|mask|>`` (tokenizer, embeddings, config.mask_token_id) when missing; return its id."""
    transformers_model = cast("PreTrainedModel", model)
    mask_id = find_mask_id(transformers_model.config, tokenizer)
    if mask_id is None:
        mask_id = add_mask_tokens(tokenizer)
    rows = cast(torch.nn.Embedding, transformers_model.get_input_embeddings()).weight.shape[0]
    if mask_id >= rows:
        transformers_model.resize_token_embeddings(max(len(tokenizer), mask_id + 1))
    transformers_model.config.mask_token_id = mask_id
    return mask_id


def add_mask_tokens(tokenizer) -> int:
    """Add ``<|beginoftext|>`` (when missing) then ``<|mask|>`` as special tokens, in the reference's
    order; return the mask id (151670 on a Qwen3 tokenizer)."""
    if BEGIN_TOKEN not in tokenizer.get_vocab():  # kept beside the tokenizer's other extra special tokens
        tokenizer.add_special_tokens({"additional_special_tokens": [BEGIN_TOKEN]}, replace_extra_special_tokens=False)
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    return int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))


def pad_id_of(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise UserError("the tokenizer defines neither a pad nor an EOS token")
    return int(pad)


def load_tokenizer(path: str):
    """The tokenizer for --init: a local directory, an embedded model's name, or a hub id (tried
    only when the hub answers, as for models), located as a checkpoint is (``models.checkpoint.locate``)."""
    from transformers import AutoTokenizer

    if kind_of(path) is None:
        raise UserError(f"the tokenizer directory '{path}' does not exist")
    location = locate(path)
    if location.kind is Kind.FOLDER:
        local = Path(location.source)
        if not local.is_dir():
            raise UserError(f"--tokenizer '{path}' is a file; give the directory that holds the tokenizer files")
        if not any((local / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(f"'{path}' holds no tokenizer ({' or '.join(TOKENIZER_FILES)})",
                            hint="give a directory written by save_pretrained, e.g. refusion_cli/assets/refusion-tiny")
    try:
        return location.read(AutoTokenizer.from_pretrained)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"cannot load a tokenizer from '{location.source}': {str(exc).splitlines()[0]}") from exc


def build_tiny_model(name: str, tokenizer, overrides: dict[str, object], seed: int) -> TrainableModel:
    """A freshly initialised Qwen3 from a named config, sized to the tokenizer's vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if name not in TINY_CONFIGS:
        raise UserError(f"unknown --init config '{name}'; choose one of {', '.join(TINY_CONFIGS)}")
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer defines no EOS token")
    mask_id = find_mask_id(None, tokenizer)
    if mask_id is None:
        mask_id = add_mask_tokens(tokenizer)
    fields: dict[str, Any] = {**TINY_CONFIGS[name], "vocab_size": len(tokenizer), **overrides}  # Qwen3Config checks
    check_model_fields(fields)  # the named config's heads with overridden kv heads, or the other way round
    if isinstance(fields["vocab_size"], int) and fields["vocab_size"] < len(tokenizer):
        raise UserError(f"--model-config vocab_size {fields['vocab_size']} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens")
    fields.update(mask_token_id=mask_id, eos_token_id=int(tokenizer.eos_token_id), pad_token_id=pad_id_of(tokenizer))
    try:
        config = Qwen3Config(**fields)
        with torch.random.fork_rng(devices=[]):  # the seed decides the init without touching the global RNG
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
    except (StrictDataclassError, ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: out of memory
        reason = str(exc.__cause__ or exc).splitlines()[0]  # a StrictDataclassError's cause names the field
        raise UserError(f"cannot build the '{name}' model with these --model-config fields: {reason}") from exc
    return TrainableModel(model.float().train(), tokenizer, int(mask_id), pad_id_of(tokenizer))


def load_checkpoint_for_training(checkpoint: str | Checkpoint) -> TrainableModel:
    """A checkpoint (embedded name, local directory or hub id; a string is resolved first) in float32 with
    gradients on."""
    if isinstance(checkpoint, str):
        checkpoint = resolve_checkpoint(checkpoint)
    loaded = load_model(checkpoint, device="cpu", dtype=torch.float32, require_mask=False)
    model = loaded.model.train().requires_grad_(True)
    tokenizer = loaded.tokenizer
    if find_mask_id(model.config, tokenizer) is None:  # tokens are added to a copy: the loader's is shared
        tokenizer = copy.deepcopy(tokenizer)
    mask_id = ensure_mask_token(model, tokenizer)
    return TrainableModel(model, tokenizer, mask_id, pad_id_of(tokenizer))


def prepare_for_objective(model: torch.nn.Module, objective: Objective) -> None:
    """Record the attention the objective trains (and, for a masked-diffusion objective, whether it reads
    token i from position i-1: ``shifted_logits``, which decides between the dream and llada decoders);
    refuse backends and layouts the explicit masks cannot drive."""
    config = cast("PreTrainedConfig", model.config)
    config.is_causal = not objective.bidirectional
    if objective.bidirectional:
        config.shifted_logits = objective.shifted
    if config._attn_implementation not in SUPPORTED_ATTENTION:
        raise UserError(f"training passes explicit 4-D attention masks, which the "
                        f"'{config._attn_implementation}' attention backend does not take",
                        hint=f"load the model with one of: {', '.join(SUPPORTED_ATTENTION)}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise UserError("training supports full-attention layers only (this model uses sliding-window layers)")


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
