"""Load a checkpoint (embedded name, local directory or hub id) -> model, tokenizer, special ids.

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

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refusion_cli.decoding.registry import check_decoder_fits
from refusion_cli.errors import UserError
from refusion_cli.models import gguf
from refusion_cli.models.adapters import apply_adapter, parse_model, resolve_adapter
from refusion_cli.models.devices import default_dtype, parse_device, parse_dtype
from refusion_cli.models.hub import offline_unless_hub_answers
from refusion_cli.models.layouts import NativeLayout, native_layout

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED = ("refusion-tiny", "ar-tiny", "mdm-tiny")  # shipped in refusion_cli/assets/<name>/
DEFAULT_MODEL = "refusion-tiny"
MASK_TOKEN = "<|mask|>"
# what a checkpoint's broken files or its own code raise while loading
LOAD_ERRORS = (OSError, ValueError, KeyError, AttributeError, TypeError, RuntimeError, ImportError, NotImplementedError)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer
    mask_token_id: int | None  # None for plain AR checkpoints loaded with require_mask=False
    eos_token_id: int  # the end of a chat turn (see _eos_id); what training appends and padding uses
    pad_token_id: int
    family: str  # "qwen3", "llada", "dream", ... (the config's model_type)
    bidirectional: bool  # True for masked-diffusion models (LLaDA, Dream, a Qwen3 with is_causal=False)
    source: str  # the directory the weights came from
    # every id that ends a response: eos_token_id, then the generation config's other EOS ids
    # (Qwen3 chat checkpoints list <|im_end|> and <|endoftext|>), as transformers' generate stops
    stop_token_ids: tuple[int, ...]
    shifted: bool | None = None  # a masked-diffusion model trained for shifted logits (Dream); None: not recorded
    adapter: str | None = None  # the folder of the LoRA adapter put into the model (None: none)


def embedded_path(name: str) -> Path:
    return ASSETS / name


def is_embedded(name: str) -> bool:
    """Whether ``name`` means a shipped model: one of EMBEDDED, and no local path of that name."""
    return name in EMBEDDED and not Path(name).expanduser().exists()


def resolve_source(name_or_path: str) -> tuple[str, bool]:
    """Return (what to pass to from_pretrained, local_files_only).

    A local directory comes first, as in ``from_pretrained``: ``refusion-tiny`` is the embedded
    model unless the working directory holds a folder of that name.
    """
    path = Path(name_or_path).expanduser()
    if gguf.is_gguf(name_or_path):  # one file: config, tokenizer and weights
        return gguf.resolve_gguf(name_or_path), True
    if is_embedded(name_or_path):
        path = embedded_path(name_or_path)
        if not (path / "config.json").is_file():
            raise UserError(
                f"the embedded model '{name_or_path}' is not built in this checkout ({path} is missing)",
                hint="rebuild the embedded models with `make models` (see docs/training.md, 'The embedded models')",
            )
        return str(path), True
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"'{name_or_path}' is a local path but holds no config.json: not a checkpoint directory")
        return str(path), True
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise UserError(f"no such checkpoint directory: '{name_or_path}'",
                        hint=f"give a local directory, a hub id such as GSAI-ML/ReFusion, or one of {', '.join(EMBEDDED)}")
    return name_or_path, offline_unless_hub_answers()


def read_config_dict(source: str, local_only: bool, name: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict (no config class is built, no code runs)."""
    from transformers import PretrainedConfig

    try:
        raw, _ = gguf.read_checkpoint(PretrainedConfig.get_config_dict, source, name, local_files_only=local_only)
    except OSError as exc:
        raise _config_error(exc, source, local_only, name) from exc
    except ValueError as exc:
        raise UserError(f"cannot read the config of '{name}': {str(exc).splitlines()[0]}") from exc
    return raw


def _config_error(exc: OSError, source: str, local_only: bool, name: str) -> UserError:
    if local_only and not Path(source).exists():
        return UserError(
            f"'{name}' is not a local directory, the model hub is unreachable, and it is not in the local cache",
            hint="download it on a machine with access and pass the directory, or set HF_HOME to a cache holding it",
        )
    return UserError(f"cannot read the config of '{name}': {exc}".splitlines()[0])


def load_config(source: str, local_only: bool, trust_remote_code: bool, name: str):
    from transformers import AutoConfig

    try:
        return gguf.read_checkpoint(AutoConfig.from_pretrained, source, name, local_files_only=local_only,
                                    trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise _config_error(exc, source, local_only, name) from exc
    except ValueError as exc:
        text = str(exc)
        if "trust_remote_code" in text or "custom code" in text:
            raise UserError(
                f"'{name}' ships its own modelling code; loading it runs that code",
                hint="pass --trust-remote-code (trust_remote_code=True) if you trust its authors",
            ) from exc
        raise UserError(f"cannot read the config of '{name}': {text.splitlines()[0]}") from exc
    except LOAD_ERRORS as exc:  # a checkpoint's own configuration code failing
        raise UserError(f"cannot read the config of '{name}': {_first_line(exc)}",
                        hint="its configuration code may be written for another transformers release") from exc


def find_mask_id(config, tokenizer) -> int | None:
    """The mask id from the config (``mask_token_id``), else from the tokenizer's ``<|mask|>`` token."""
    mask_id = getattr(config, "mask_token_id", None)
    if mask_id is not None:
        return int(mask_id)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    return int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else None


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's config says, read without loading weights or tokenizer."""

    source: str  # the local directory or hub id to load from
    local_only: bool  # load from local files only (embedded, a directory, or the hub unreachable)
    config: Any
    family: str  # config.model_type
    remote: bool  # loads with the modelling code shipped with the checkpoint (trust_remote_code)
    bidirectional: bool  # a masked-diffusion model (LLaDA, Dream, remote code, or config.is_causal False)
    shifted: bool | None = None  # reads token i from position i-1 (Dream) or not (LLaDA); None: not recorded
    layout: NativeLayout | None = None  # LLaDA or Dream, loaded onto a stock class (models.layouts)
    adapter: Path | None = None  # a LoRA adapter's local folder, put into the model after its weights load


def inspect_checkpoint(name_or_path: str, trust_remote_code: bool = False) -> CheckpointInfo:
    """Resolve a checkpoint and read its config: a missing or unusable one fails here, before any weights load.

    LLaDA and Dream get their stock config (``models.layouts``); a model type transformers knows gets
    transformers' own config class; any other with an ``auto_map`` gets its own, with ``trust_remote_code``.
    A value naming a LoRA adapter (``ADAPTER_DIR`` or ``BASE+ADAPTER``, ``models.adapters``) is its base's
    info with the adapter's folder.
    """
    spec = parse_model(name_or_path)
    if spec.adapter is None:
        return inspect_base(name_or_path, trust_remote_code)
    if gguf.is_gguf(spec.base):
        raise UserError(f"--model {name_or_path}: an adapter cannot go on a GGUF file")
    try:
        info = inspect_base(spec.base, trust_remote_code)
    except UserError as exc:
        if not spec.base_from_adapter:
            raise
        raise UserError(f"the adapter '{spec.adapter}' is for '{spec.base}', which cannot be loaded: {exc}",
                        hint=f"give the base with it: --model BASE+{spec.adapter}") from exc
    return dataclasses.replace(info, adapter=resolve_adapter(spec.adapter))


def inspect_base(name_or_path: str, trust_remote_code: bool = False) -> CheckpointInfo:
    """:func:`inspect_checkpoint` of a checkpoint alone."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    source, local_only = resolve_source(name_or_path)
    raw = read_config_dict(source, local_only, name_or_path)
    family = str(raw.get("model_type") or "")
    layout = native_layout(family)
    if layout is not None:
        config = layout.build_config(raw, name_or_path)
        return CheckpointInfo(source, local_only, config, family.lower(), False, True, layout.shifted, layout)
    remote = bool(raw.get("auto_map")) and family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if remote and not trust_remote_code:
        raise UserError(f"'{name_or_path}' is a '{family}' checkpoint that needs its authors' modelling code",
                        hint="pass --trust-remote-code (trust_remote_code=True) to run it")
    if not remote and family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"'{name_or_path}' is a '{family}' checkpoint, not a causal language model")
    if remote and not {"AutoModelForCausalLM", "AutoModel"} & set(raw["auto_map"]):
        raise UserError(f"'{name_or_path}' maps no model class in its config's auto_map "
                        f"(it lists {', '.join(sorted(raw['auto_map']))})",
                        hint="its auto_map needs an AutoModelForCausalLM or AutoModel entry")
    config = load_config(source, local_only, remote, name_or_path)  # remote code only for a type transformers lacks
    bidirectional = remote or not getattr(config, "is_causal", True)
    shifted = getattr(config, "shifted_logits", None)
    return CheckpointInfo(source, local_only, config, family, remote, bidirectional, shifted)


def check_model_fits(decoder: str, name_or_path: str, trust_remote_code: bool = False) -> None:
    """The checkpoint is there (or on the hub) and suits ``decoder``, judged from its config alone."""
    info = inspect_checkpoint(name_or_path, trust_remote_code)
    gguf.check_gguf_decoder(decoder, name_or_path)
    check_decoder_fits(decoder, info.bidirectional, shifted=info.shifted)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    trust_remote_code: bool = False,
    require_mask: bool = True,
) -> LoadedModel:
    """Load a checkpoint for decoding (eval mode, no gradients).

    ``require_mask=False`` accepts plain AR checkpoints (e.g. ``Qwen/Qwen3-8B``) that have no mask token.
    """
    device = parse_device(device)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    dtype = dtype or default_dtype(device)
    if require_mask and gguf.is_gguf(name_or_path):
        raise gguf.mask_decoder_error(name_or_path)
    info = inspect_checkpoint(name_or_path, trust_remote_code)
    config, family = info.config, info.family
    tokenizer = load_tokenizer(info, name_or_path)
    mask_id = find_mask_id(config, tokenizer)
    if mask_id is None and require_mask:
        raise UserError(f"'{name_or_path}' has no mask token (no mask_token_id in its config, no {MASK_TOKEN} token)",
                        hint="a diffusion decoder needs one; use the AR decoder for plain causal models")
    eos_id = _eos_id(config, tokenizer)
    if eos_id is None:
        raise UserError(f"'{name_or_path}' defines no EOS token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    model = load_weights(info, name_or_path, dtype)
    if info.adapter is not None:
        apply_adapter(model, info.adapter, name_or_path, info.layout, family)
        model.to(dtype)  # the LoRA weights in the model's dtype, as the authors' loaders cast them
    if info.bidirectional and not info.remote:
        make_bidirectional(model)
    model.to(device).eval().requires_grad_(False)
    stops = stop_ids(int(eos_id), getattr(model, "generation_config", None), model.config,
                     vocab_size=model.get_input_embeddings().num_embeddings, name=name_or_path)
    return LoadedModel(model, tokenizer, mask_id, int(eos_id), int(pad_id), family, info.bidirectional, info.source,
                       stops, info.shifted, None if info.adapter is None else str(info.adapter))


def load_tokenizer(info: CheckpointInfo, name: str) -> Any:
    """The checkpoint's tokenizer: a stock class for LLaDA and Dream, remote code only for a remote checkpoint."""
    import transformers

    layout_class = info.layout.tokenizer_class if info.layout is not None else None
    try:
        if layout_class is not None:
            return getattr(transformers, layout_class).from_pretrained(info.source, local_files_only=info.local_only)
        return gguf.read_checkpoint(transformers.AutoTokenizer.from_pretrained, info.source, name,
                                    local_files_only=info.local_only, trust_remote_code=info.remote)
    except LOAD_ERRORS as exc:
        raise UserError(f"cannot load the tokenizer of '{name}': {_first_line(exc)}", hint=_load_hint(info)) from exc


def model_class(info: CheckpointInfo) -> Any:
    """The class the weights load into: the layout's stock class, transformers' own class for the config's
    type, or (remote code) the checkpoint's AutoModelForCausalLM, else AutoModel, entry."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if info.layout is not None:
        return getattr(transformers, info.layout.model_class)
    if not info.remote:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(info.config)]
    if "AutoModelForCausalLM" in (info.config.auto_map or {}):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel  # LLaDA and Dream register AutoModel only


def load_weights(info: CheckpointInfo, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The weights in ``model_class(info)``; a weight the model needs and the checkpoint lacks is an error
    (transformers would initialise it at random)."""
    options: dict[str, Any] = {"config": info.config, "dtype": dtype, "local_files_only": info.local_only,
                               "output_loading_info": True}
    if info.remote:
        options["trust_remote_code"] = True
    if info.layout is not None and info.layout.key_mapping:
        options["key_mapping"] = dict(info.layout.key_mapping)
    try:
        with _no_progress_bar(is_embedded(name)):  # a 10 MB model needs no "Loading weights" bar
            model, loading = gguf.read_checkpoint(model_class(info).from_pretrained, info.source, name, **options)
    except LOAD_ERRORS as exc:
        raise UserError(f"cannot load the weights of '{name}': {_first_line(exc)}", hint=_load_hint(info)) from exc
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise UserError(f"cannot load the weights of '{name}': the checkpoint lacks {shown}",
                        hint="the checkpoint is incomplete, or its weight names are not the layout its config names")
    return model


def make_bidirectional(model: torch.nn.Module) -> None:
    """Full attention in every backend: the config's flag (masks) and every attention module's (SDPA and
    flash attention read it when no mask is passed)."""
    model.config.is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _load_hint(info: CheckpointInfo) -> str:
    if info.remote:
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
