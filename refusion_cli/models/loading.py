"""Load a checkpoint -> model, tokenizer, special ids, from its record (:mod:`refusion_cli.models.checkpoint`).

Every command resolves its ``--model`` values first (:func:`resolve_checkpoint`, also known here as
:func:`inspect_checkpoint`), checks each decoder's fit from the record (:func:`check_model_fits`), then loads
(:func:`load_model`), reading the record: nothing here goes back to the string. ``load_model`` and
``check_model_fits`` also take the string, and resolve it first.

A ReFusion checkpoint is a stock Qwen3 causal LM whose config carries ``mask_token_id`` (the
official ``GSAI-ML/ReFusion`` is Qwen3-8B with ``<|mask|>`` = 151670), so it loads with the
transformers class, never with remote code. LLaDA and Dream ship their own modelling code, written
for transformers 4; they load natively instead, onto ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
with bidirectional attention (:mod:`refusion_cli.models.layouts`). A model type transformers knows
always loads with transformers' own config and model classes (an ``auto_map`` in its config is
ignored); any other checkpoint with an ``auto_map`` loads with its own pair of classes, only when the
caller passes ``trust_remote_code=True``. Whatever fails to load is a one-line ``UserError``.

A ``--model`` value may also name a PEFT LoRA adapter with its base (``ADAPTER_DIR`` or ``BASE+ADAPTER``):
the base loads as above and the adapter goes into it unmerged (:mod:`refusion_cli.models.adapters`).

The hub is optional: a local directory always works; a hub id is tried only when the hub answers
quickly, otherwise only the local Hugging Face cache is consulted and a miss is a one-line error.
The hub probe is :mod:`refusion_cli.models.hub`; the device and dtype are parsed by
:mod:`refusion_cli.models.devices`.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from refusion_cli.decoding.batching import input_vocabulary
from refusion_cli.decoding.registry import check_decoder_fits, decoder_spec
from refusion_cli.errors import UserError
from refusion_cli.models import gguf
from refusion_cli.models.adapters import apply_adapter
from refusion_cli.models.checkpoint import (ASSETS, DEFAULT_MODEL, EMBEDDED, LOAD_ERRORS, Checkpoint, Kind,
                                            embedded_path, first_line, is_embedded, resolve_checkpoint)
from refusion_cli.models.devices import default_dtype, parse_device, parse_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

MASK_TOKEN = "<|mask|>"
inspect_checkpoint = resolve_checkpoint  # the name the serve command and the stand-in tests know it by


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer (its decode is typed str | list[str], for batches)
    mask_token_id: int | None  # None for plain AR checkpoints loaded with require_mask=False
    eos_token_id: int  # the end of a chat turn (see _eos_id); what training appends and padding uses
    pad_token_id: int
    family: str  # "qwen3", "llada", "dream", ... (the config's model_type)
    bidirectional: bool  # True for masked-diffusion models (LLaDA, Dream, a Qwen3 with is_causal=False)
    source: str  # the directory the weights came from (a GGUF file's path, a hub id)
    # every id that ends a response: eos_token_id, then the generation config's other EOS ids
    # (Qwen3 chat checkpoints list <|im_end|> and <|endoftext|>), as transformers' generate stops
    stop_token_ids: tuple[int, ...]
    shifted: bool | None = None  # a masked-diffusion model trained for shifted logits (Dream); None: not recorded
    adapter: str | None = None  # the folder of the LoRA adapter put into the model (None: none)


def find_mask_id(config, tokenizer) -> int | None:
    """The mask id from the config (``mask_token_id``), else from the tokenizer's ``<|mask|>`` token."""
    mask_id = getattr(config, "mask_token_id", None)
    if mask_id is not None:
        return int(mask_id)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    return int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else None


def check_model_fits(decoder: str, checkpoint: str | Checkpoint, trust_remote_code: bool = False) -> None:
    """The checkpoint suits ``decoder``, judged from its record (a string is resolved first): its attention
    (causal or bidirectional) and logits (shifted or not); a GGUF file runs with the AR decoder only."""
    if isinstance(checkpoint, str):
        checkpoint = resolve_checkpoint(checkpoint, trust_remote_code)
    if checkpoint.kind is Kind.GGUF and decoder_spec(decoder).needs_mask:
        raise gguf.mask_decoder_error(checkpoint.name, decoder)
    check_decoder_fits(decoder, checkpoint.bidirectional, shifted=checkpoint.shifted)


def load_model(
    checkpoint: str | Checkpoint = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    trust_remote_code: bool = False,
    require_mask: bool = True,
) -> LoadedModel:
    """Load a checkpoint for decoding (eval mode, no gradients), from its record (a string is resolved first,
    with ``trust_remote_code``).

    ``require_mask=False`` accepts plain AR checkpoints (e.g. ``Qwen/Qwen3-8B``) that have no mask token.
    """
    device = parse_device(device)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    dtype = dtype or default_dtype(device)
    if isinstance(checkpoint, str):
        checkpoint = resolve_checkpoint(checkpoint, trust_remote_code)
    name = checkpoint.name
    if require_mask and checkpoint.kind is Kind.GGUF:
        raise gguf.mask_decoder_error(name)
    tokenizer = load_tokenizer(checkpoint)
    mask_id = find_mask_id(checkpoint.config, tokenizer)
    if mask_id is None and require_mask:
        raise UserError(f"'{name}' has no mask token (no mask_token_id in its config, no {MASK_TOKEN} token)",
                        hint="a diffusion decoder needs one; use the AR decoder for plain causal models")
    eos_id = _eos_id(checkpoint.config, tokenizer)
    if eos_id is None:
        raise UserError(f"'{name}' defines no EOS token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    model = load_weights(checkpoint, dtype)
    if checkpoint.adapter is not None:
        apply_adapter(model, checkpoint.adapter, name, checkpoint.layout, checkpoint.family)
        model.to(dtype)  # the LoRA weights in the model's dtype, as the authors' loaders cast them
    if checkpoint.bidirectional and not checkpoint.remote:
        make_bidirectional(model)
    model.to(device).eval().requires_grad_(False)
    stops = stop_ids(int(eos_id), getattr(model, "generation_config", None), model.config,
                     vocab_size=input_vocabulary(model), name=name)
    adapter = None if checkpoint.adapter is None else str(checkpoint.adapter.folder)
    return LoadedModel(model, tokenizer, mask_id, int(eos_id), int(pad_id), checkpoint.family,
                       checkpoint.bidirectional, checkpoint.source, stops, checkpoint.shifted, adapter)


TOKENIZERS_KEPT = 4  # the tokenizers a process keeps for the next load of the same files (load_tokenizer)
_tokenizers: OrderedDict[tuple[Any, ...], Any] = OrderedDict()  # by tokenizer_key, the latest used last


def load_tokenizer(checkpoint: Checkpoint) -> Any:
    """The checkpoint's tokenizer: a stock class for LLaDA and Dream, remote code only for a remote checkpoint
    (the config is the record's: transformers does not read it again).

    The same files give the same object (a tokenizer of Qwen's 151k tokens takes seconds to build; eval,
    bench and serve load a checkpoint once per decoder): callers read it and never change it."""
    import transformers

    key = tokenizer_key(checkpoint)
    if key in _tokenizers:
        _tokenizers.move_to_end(key)
        return _tokenizers[key]
    layout_class = checkpoint.layout.tokenizer_class if checkpoint.layout is not None else None
    try:
        if layout_class is not None:
            tokenizer = checkpoint.read(getattr(transformers, layout_class).from_pretrained)
        else:
            tokenizer = checkpoint.read(transformers.AutoTokenizer.from_pretrained, config=checkpoint.config,
                                        trust_remote_code=checkpoint.remote)
    except LOAD_ERRORS as exc:
        raise UserError(f"cannot load the tokenizer of '{checkpoint.name}': {first_line(exc)}",
                        hint=_load_hint(checkpoint)) from exc
    _tokenizers[key] = tokenizer
    while len(_tokenizers) > TOKENIZERS_KEPT:
        _tokenizers.popitem(last=False)
    return tokenizer


def tokenizer_key(checkpoint: Checkpoint) -> tuple[Any, ...]:
    """What identifies the files a tokenizer loads from: the base checkpoint's fingerprint (a hub commit, a GGUF
    file's, a folder's config and weights; an adapter changes the weights, not the base's tokenizer) and, for a
    folder, every other file's name, size and mtime."""
    files: list[tuple[str, int, int]] = []
    if checkpoint.kind in (Kind.EMBEDDED, Kind.FOLDER):
        for path in sorted(Path(checkpoint.source).iterdir()):
            if path.is_file() and path.suffix not in (".safetensors", ".bin"):
                stat = path.stat()
                files.append((path.name, stat.st_size, stat.st_mtime_ns))
    return checkpoint.base_fingerprint, checkpoint.remote, tuple(files)


def model_class(checkpoint: Checkpoint) -> Any:
    """The class the weights load into: the layout's stock class, transformers' own class for the config's
    type, or (remote code) the checkpoint's AutoModelForCausalLM, else AutoModel, entry."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if checkpoint.layout is not None:
        return getattr(transformers, checkpoint.layout.model_class)
    if not checkpoint.remote:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(checkpoint.config)]
    if "AutoModelForCausalLM" in (checkpoint.config.auto_map or {}):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel  # LLaDA and Dream register AutoModel only


def load_weights(checkpoint: Checkpoint, dtype: torch.dtype) -> torch.nn.Module:
    """The weights in ``model_class(checkpoint)``; a weight the model needs and the checkpoint lacks is an error
    (transformers would initialise it at random)."""
    name = checkpoint.name
    options: dict[str, Any] = {"config": checkpoint.config, "dtype": dtype, "output_loading_info": True}
    if checkpoint.remote:
        options["trust_remote_code"] = True
    if checkpoint.layout is not None and checkpoint.layout.key_mapping:
        options["key_mapping"] = dict(checkpoint.layout.key_mapping)
    try:
        with _no_progress_bar(checkpoint.kind is Kind.EMBEDDED):  # a 10 MB model needs no "Loading weights" bar
            model, loading = checkpoint.read(model_class(checkpoint).from_pretrained, **options)
    except LOAD_ERRORS as exc:
        raise UserError(f"cannot load the weights of '{name}': {first_line(exc)}",
                        hint=_load_hint(checkpoint)) from exc
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise UserError(f"cannot load the weights of '{name}': the checkpoint lacks {shown}",
                        hint="the checkpoint is incomplete, or its weight names are not the layout its config names")
    return model


def make_bidirectional(model: torch.nn.Module) -> None:
    """Full attention in every backend: the config's flag (masks) and every attention module's (SDPA and
    flash attention read it when no mask is passed)."""
    cast("PreTrainedConfig", model.config).is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal"):
            setattr(module, "is_causal", False)  # torch types a module attribute as a tensor or a module


def _load_hint(checkpoint: Checkpoint) -> str:
    if checkpoint.remote:
        import transformers

        return (f"its own modelling code failed under transformers {transformers.__version__}; the code may be "
                "written for another transformers release (--debug shows the traceback)")
    return "check that the directory holds the complete checkpoint (--debug shows the traceback)"


@contextmanager
def _no_progress_bar(active: bool):
    """Turn transformers' progress bars off for the block (when ``active``), then back to what they were."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    if active and was_enabled:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if active and was_enabled:
            transformers_logging.enable_progress_bar()


def _eos_id(config, tokenizer) -> int | None:
    """The end of a chat turn: the tokenizer's EOS (``<|im_end|>`` for Qwen3 chat models), else the config's."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)


def stop_ids(eos_id: int, generation_config, config, *, vocab_size: int | None = None,
             name: str = "the checkpoint") -> tuple[int, ...]:
    """``eos_id`` first, then every other EOS id of the generation config (else the model config).

    An id that is not an integer, or not below ``vocab_size``, is a UserError naming the file that lists it.
    """
    from_generation = getattr(generation_config, "eos_token_id", None) is not None
    source = generation_config if from_generation else config
    listed = getattr(source, "eos_token_id", None)
    if listed is None:
        listed = []
    elif not isinstance(listed, (list, tuple)):
        listed = [listed]
    for token in listed:
        if not is_token_id(token) or vocab_size is not None and not 0 <= token < vocab_size:
            where = "generation_config.json" if from_generation else "config.json"
            size = f" (the vocabulary has {vocab_size} ids)" if is_token_id(token) else ""
            raise UserError(f"'{name}' lists eos_token_id {listed!r} in its {where}: {token!r} is not a token id"
                            f"{size}", hint=f"give eos_token_id in {where} as one token id or a list of them")
    return tuple(dict.fromkeys([eos_id, *listed]))


def is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["ASSETS", "DEFAULT_MODEL", "EMBEDDED", "MASK_TOKEN", "Checkpoint", "LoadedModel", "check_model_fits",
           "embedded_path", "find_mask_id", "inspect_checkpoint", "is_embedded", "load_model", "resolve_checkpoint",
           "stop_ids"]
