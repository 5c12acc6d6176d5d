"""Checkpoints that ship their authors' modelling code, loaded onto transformers' own classes instead.

LLaDA-8B-Instruct (``model_type`` ``llada``) is a Llama stack under OLMo's names; Dream-v0-7B
(``model_type`` ``Dream``) is Qwen2.5's stack under Qwen2's names. Each :class:`NativeLayout` turns
the checkpoint's own ``config.json`` into the stock config (``LlamaConfig`` / ``Qwen2Config``) with
bidirectional attention, and maps its weight names onto the stock model's at load time (the
``key_mapping`` of ``from_pretrained``), so these checkpoints load without remote code and get what
every stock model has: position ids, 4-D masks, KV caches, SDPA / flash attention, batching.

A config field the mapping does not carry over (a bias, ALiBi, weight tying other than LLaDA's own
switch, ...) is refused with a ``UserError`` rather than loaded into a model that computes
something else.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from refusion_cli.errors import UserError


@dataclass(frozen=True)
class NativeLayout:
    """How one family of remote-code checkpoints maps onto a stock transformers class."""

    label: str  # the family's name in messages
    model_class: str  # the stock transformers class its weights load into
    build_config: Callable[[dict[str, Any], str], Any]  # (config.json as a dict, checkpoint name) -> stock config
    key_mapping: Mapping[str, str]  # regex on checkpoint weight names -> the stock model's names
    shifted: bool  # logits read shifted (position i-1 predicts token i: Dream) or not (LLaDA)
    tokenizer_class: str | None = None  # a stock tokenizer class in place of a remote-code one (None: AutoTokenizer)
    # regex on the stock model's module names -> the checkpoint's own (the inverse of key_mapping, module by module);
    # empty: the names are the same
    own_names: Mapping[str, str] = field(default_factory=dict)

    def own_module_name(self, stock_name: str) -> str | None:
        """The checkpoint's own name of the stock model's module ``stock_name`` (what an adapter trained on the
        checkpoint's own code calls it); None for a module the checkpoint's code has no counterpart of."""
        if not self.own_names:
            return stock_name
        for pattern, replacement in self.own_names.items():
            renamed, count = re.subn(pattern, replacement, stock_name)
            if count:
                return renamed
        return None


def _refuse(name: str, label: str, field: str, value: Any, expected: Any) -> UserError:
    needs = " or ".join(map(repr, expected)) if isinstance(expected, tuple) else repr(expected)
    return UserError(f"'{name}' is a {label} checkpoint with {field}={value!r}; loading it natively needs "
                     f"{field}={needs}",
                     hint="load it with its authors' code instead (--trust-remote-code) if that code runs here")


def _require(raw: dict[str, Any], name: str, label: str, expected: Mapping[str, Any]) -> None:
    for field, wanted in expected.items():
        allowed = wanted if isinstance(wanted, tuple) else (wanted,)
        if field in raw and raw[field] not in allowed:
            raise _refuse(name, label, field, raw[field], wanted)


def _with_ids(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` plus the special-token ids the checkpoint's config names; an id it does not name is None,
    never the stock class's default (Llama's bos 1 and eos 2 mean other tokens in LLaDA's vocabulary)."""
    fields.update({key: raw.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    if raw.get("mask_token_id") is not None:
        fields["mask_token_id"] = raw["mask_token_id"]
    return fields


def llada_config(raw: dict[str, Any], name: str) -> Any:
    """LLaDA's OLMo-style ``config.json`` as a bidirectional ``LlamaConfig``."""
    from transformers import LlamaConfig

    label = "LLaDA"
    _require(raw, name, label, {
        "block_type": "llama", "activation_type": ("silu", "swiglu"), "layer_norm_type": "rms", "rope": True,
        "alibi": False, "include_bias": False, "include_qkv_bias": False, "bias_for_layer_norm": (False, None),
        "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False, "clip_qkv": None,
        "multi_query_attention": (None, False), "layer_norm_with_affine": True, "block_group_size": 1,
    })
    try:
        hidden, heads = int(raw["d_model"]), int(raw["n_heads"])
        fields = {
            "vocab_size": int(raw.get("embedding_size") or raw["vocab_size"]),  # the rows of wte and of the head
            "hidden_size": hidden,
            "intermediate_size": int(raw.get("mlp_hidden_size") or raw["mlp_ratio"] * hidden),
            "num_hidden_layers": int(raw["n_layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(raw.get("n_kv_heads") or heads),
            "head_dim": hidden // heads,
            "max_position_embeddings": int(raw.get("max_sequence_length", 4096)),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(raw.get("rope_theta", 10000.0)),
            "tie_word_embeddings": bool(raw.get("weight_tying", False)),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"'{name}' is a LLaDA checkpoint whose config.json lacks or garbles {exc}") from None
    config = LlamaConfig(**_with_ids(raw, fields))
    return _bidirectional(config)


def dream_config(raw: dict[str, Any], name: str) -> Any:
    """Dream's ``config.json`` (Qwen2's fields under ``model_type`` ``Dream``) as a bidirectional ``Qwen2Config``."""
    from transformers import Qwen2Config

    _require(raw, name, "Dream", {"use_sliding_window": False, "use_mrope": False, "hidden_act": "silu",
                                  "rope_scaling": None})
    dropped = {"model_type", "architectures", "auto_map", "_name_or_path", "transformers_version", "torch_dtype",
               "dtype", "use_mrope"}
    try:
        config = Qwen2Config(**{key: value for key, value in raw.items() if key not in dropped})
    except (TypeError, ValueError) as exc:
        raise UserError(f"'{name}' is a Dream checkpoint whose config.json does not read as Qwen2's: "
                        f"{str(exc).splitlines()[0]}") from None
    return _bidirectional(config)


def _bidirectional(config: Any) -> Any:
    config.is_causal = False
    return config


# LLaDA's module names -> Llama's: under model.transformer, and in each of its blocks
LLADA_TOP_NAMES = {"wte": "model.embed_tokens", "ln_f": "model.norm",
                   "ff_out": "lm_head"}  # the output head; a block's ff_out is its down projection
LLADA_BLOCK_NAMES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                     "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                     "ff_out": "mlp.down_proj", "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm"}

LLADA_KEY_MAPPING: dict[str, str] = {  # on weight names (and adapter weight names): a prefix up to a dot
    **{rf"^model\.transformer\.{old}\.": f"{new}." for old, new in LLADA_TOP_NAMES.items()},
    **{rf"^model\.transformer\.blocks\.(\d+)\.{old}\.": rf"model.layers.\1.{new}."
       for old, new in LLADA_BLOCK_NAMES.items()},
}
LLADA_OWN_NAMES: dict[str, str] = {  # on whole module names, the other way
    **{rf"^{re.escape(new)}$": f"model.transformer.{old}" for old, new in LLADA_TOP_NAMES.items()},
    **{rf"^model\.layers\.(\d+)\.{re.escape(new)}$": rf"model.transformer.blocks.\1.{old}"
       for old, new in LLADA_BLOCK_NAMES.items()},
}

# keyed by config.json's model_type, lower-cased
NATIVE_LAYOUTS: dict[str, NativeLayout] = {
    "llada": NativeLayout("LLaDA", "LlamaForCausalLM", llada_config, LLADA_KEY_MAPPING, shifted=False,
                          tokenizer_class="PreTrainedTokenizerFast",  # as its tokenizer_config.json names it
                          own_names=LLADA_OWN_NAMES),
    "dream": NativeLayout("Dream", "Qwen2ForCausalLM", dream_config, {}, shifted=True,
                          tokenizer_class="Qwen2Tokenizer"),  # DreamTokenizer is Qwen2's BPE shipped as code
}


def native_layout(model_type: str | None) -> NativeLayout | None:
    """The layout of a family loaded natively (None: any other model type)."""
    return NATIVE_LAYOUTS.get(str(model_type or "").lower())


__all__ = ["LLADA_KEY_MAPPING", "LLADA_OWN_NAMES", "NATIVE_LAYOUTS", "NativeLayout", "dream_config", "llada_config",
           "native_layout"]
