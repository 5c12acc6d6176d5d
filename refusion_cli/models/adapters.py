"""PEFT LoRA adapters on a checkpoint, named together with it in one ``--model`` value.

- ``--model ADAPTER_DIR``: a folder holding peft's ``adapter_config.json`` and no ``config.json``; its
  base is the config's ``base_model_name_or_path``, resolved like any ``--model``.
- ``--model BASE+ADAPTER``: the base (an embedded name, a directory or a hub id) and the adapter (a
  directory or a hub id); a value that is an existing path is never split.

:func:`split_model` splits the value; :func:`resolve_adapter` finds the adapter's folder (a hub id fetched
or found in the local cache, at one pinned commit) and reads its ``adapter_config.json`` once, into the
:class:`Adapter` record that the checkpoint's record (:mod:`refusion_cli.models.checkpoint`) carries.

The base loads as it loads alone (LLaDA and Dream natively onto transformers' classes,
:mod:`refusion_cli.models.layouts`). :func:`apply_adapter` then puts the adapter into that model object
with peft, unmerged: each targeted linear layer gets its LoRA pair beside the base weight, as
``PeftModel.from_pretrained`` leaves it, and the model stays transformers' class (every decoder calls
it as before). An adapter trained on a checkpoint's own modelling code names that code's modules
(LLaDA's ``attn_out``, ``model.transformer.blocks.N``); its target modules are matched against those
names (the layout's ``own_module_name``) and its weight names are mapped onto the loaded model's with
the layout's ``key_mapping``, exactly as the base weights were. Whatever does not fit is one
``UserError`` line: missing files, a target the base lacks, weights that land nowhere or do not fit.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from refusion_cli.errors import UserError
from refusion_cli.models.hub import is_hub_id, offline_unless_hub_answers, pinned_revision
from refusion_cli.models.layouts import NativeLayout

SEPARATOR = "+"  # --model BASE+ADAPTER (hub ids cannot hold it)
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # peft's names, the first preferred
# LoRA settings that name modules or layers in ways the mapping onto the stock class does not translate
UNMAPPED_FIELDS = ("modules_to_save", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
                   "exclude_modules", "target_parameters", "trainable_token_indices")


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter's files, found once: where they are and what its config says."""

    name: str  # the adapter as given (a folder or a hub id)
    folder: Path  # its local folder (a hub id: the snapshot fetched or found in the local cache)
    config: dict[str, Any]  # adapter_config.json, read once
    config_sha256: str  # of adapter_config.json's bytes (the fingerprint's)
    revision: str | None = None  # a hub id's commit (None: a local folder)

    @property
    def weights(self) -> list[Path]:
        """Its weight files, in peft's order of preference."""
        return [self.folder / file for file in WEIGHT_FILES if (self.folder / file).is_file()]

    @property
    def base(self) -> str:
        """The base its config names (``base_model_name_or_path``), for ``--model ADAPTER_DIR``."""
        base = self.config.get("base_model_name_or_path")
        if not isinstance(base, str) or not base.strip():
            raise UserError(f"the adapter '{self.name}' names no base model (no base_model_name_or_path in its "
                            f"{CONFIG_FILE})", hint=f"give the base with it: --model BASE{SEPARATOR}{self.name}")
        return base.strip()


def is_adapter_folder(path: Path) -> bool:
    """A folder of peft's files: ``adapter_config.json`` and no ``config.json`` of a checkpoint."""
    return (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file()


def split_model(name: str) -> tuple[str | None, str | None]:
    """A ``--model`` value as (checkpoint, adapter): ``(name, None)`` for a checkpoint alone, ``(None, name)`` for
    an adapter folder (its base is named in its config), ``(BASE, ADAPTER)`` for ``BASE+ADAPTER``."""
    path = Path(name).expanduser()
    if path.is_dir() and is_adapter_folder(path):
        return None, name
    if path.exists() or SEPARATOR not in name:
        return name, None
    base, adapter = (part.strip() for part in name.split(SEPARATOR, 1))
    if not base or not adapter or SEPARATOR in adapter:
        raise UserError(f"--model {name}: BASE{SEPARATOR}ADAPTER takes one checkpoint and one adapter",
                        hint=f"e.g. --model GSAI-ML/LLaDA-8B-Instruct{SEPARATOR}"
                             "SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora")
    return base, adapter


def resolve_adapter(name: str) -> Adapter:
    """The adapter ``name`` (a directory, or a hub id fetched or found in the local cache): its folder, its
    config read once, checked to hold weights."""
    path, revision = Path(name).expanduser(), None
    if not path.exists():
        if not is_hub_id(name):
            raise UserError(f"no such adapter folder: '{name}'", hint="give a local folder or a hub id")
        path, revision = _fetch(name)
    if not path.is_dir():
        raise UserError(f"the adapter '{name}' is not a folder")
    text = _read_config_bytes(path, name)
    try:
        config = json.loads(text)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UserError(f"cannot read the {CONFIG_FILE} of the adapter '{name}': {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UserError(f"the {CONFIG_FILE} of the adapter '{name}' is not a JSON object")
    adapter = Adapter(name, path, config, hashlib.sha256(text).hexdigest(), revision)
    if not adapter.weights:
        raise UserError(f"the adapter '{name}' has no weights ({' or '.join(WEIGHT_FILES)})",
                        hint="the download may be incomplete")
    return adapter


def _read_config_bytes(folder: Path, name: str) -> bytes:
    try:
        return (folder / CONFIG_FILE).read_bytes()
    except FileNotFoundError:
        raise UserError(f"the adapter '{name}' has no {CONFIG_FILE}",
                        hint="an adapter folder holds peft's adapter_config.json and adapter_model.safetensors"
                        ) from None
    except OSError as exc:
        raise UserError(f"cannot read the {CONFIG_FILE} of the adapter '{name}': {exc.strerror or exc}") from None


def _fetch(repo: str) -> tuple[Path, str]:
    """The snapshot folder of the adapter ``repo`` at the commit its default branch points to, and that commit."""
    from huggingface_hub import snapshot_download

    offline = offline_unless_hub_answers()
    where = "the model hub is unreachable and it is not in the local cache"
    try:
        revision = pinned_revision(repo, offline)
        if revision is not None:
            return Path(snapshot_download(repo, revision=revision, allow_patterns=[CONFIG_FILE, *WEIGHT_FILES],
                                          local_files_only=offline)), revision
    except Exception as exc:  # huggingface_hub raises many kinds (offline miss, gated, no such repo)
        where = where if offline else str(exc).splitlines()[0]
    raise UserError(f"cannot get the adapter '{repo}': {where}",
                    hint="download it on a machine with access and pass the folder")


def apply_adapter(model: torch.nn.Module, adapter: Adapter, name: str, layout: NativeLayout | None,
                  family: str) -> None:
    """Put ``adapter`` into ``model`` (in place, unmerged); ``name``: the ``--model`` value, for messages;
    ``layout``: how the base's own module and weight names map onto ``model``'s (None: they are the same)."""
    from peft import LoraConfig, PeftConfig, inject_adapter_in_model, load_peft_weights, set_peft_model_state_dict
    from peft.tuners.tuners_utils import check_target_module_exists

    fields = {key: value for key, value in adapter.config.items() if key != "runtime_config"}  # as peft drops it
    try:
        config = PeftConfig.from_peft_type(**fields)  # what PeftConfig.from_pretrained builds from the same file
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"cannot read the adapter '{name}': {str(exc).splitlines()[0]}") from None
    if not isinstance(config, LoraConfig):
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise UserError(f"the adapter '{name}' is a {kind} adapter; only LoRA adapters load here")
    unmapped = [field for field in UNMAPPED_FIELDS if getattr(config, field, None)]
    if unmapped:
        raise UserError(f"the adapter '{name}' sets {', '.join(unmapped)}, which loading onto the {family} base's "
                        "stock class does not translate")
    base_label = layout.label if layout is not None else family
    own = {stock: layout.own_module_name(stock) if layout is not None else stock
           for stock, _ in model.named_modules() if stock}
    stock_targets = sorted(stock for stock, own_name in own.items()
                           if own_name is not None and check_target_module_exists(config, own_name))
    if config.target_modules is None:
        raise UserError(f"the adapter '{name}' names no target_modules")
    wanted = [config.target_modules] if isinstance(config.target_modules, str) else sorted(config.target_modules)
    for target in wanted:
        probe = copy.copy(config)
        probe.target_modules = target if isinstance(config.target_modules, str) else [target]
        if not any(own_name is not None and check_target_module_exists(probe, own_name) for own_name in own.values()):
            raise UserError(f"the adapter '{name}' targets {target}, which the {base_label} base has no module of",
                            hint="the adapter was made for another model family")
    mapped = copy.deepcopy(config)
    mapped.target_modules = stock_targets
    mapped.inference_mode = True
    inject_adapter_in_model(mapped, model)
    key_mapping = dict(layout.key_mapping) if layout is not None and layout.key_mapping else None
    weights = load_peft_weights(str(adapter.folder), device="cpu", key_mapping=key_mapping)
    try:
        # torch's _IncompatibleKeys, which peft annotates as collections.namedtuple (the function)
        missing_keys, unexpected_keys = cast("tuple[list[str], list[str]]", set_peft_model_state_dict(model, weights))
    except RuntimeError as exc:
        raise UserError(f"the adapter '{name}' does not fit the {base_label} base: {str(exc).splitlines()[0]}",
                        hint="the adapter was made for another model (family or size)") from None
    if unexpected_keys:
        raise UserError(f"the adapter '{name}' has weights that land on no LoRA layer of the {base_label} base, e.g. "
                        f"{unexpected_keys[0]}", hint="its config does not target every module it has weights "
                                                            "for, or it was made for another model family")
    missing = [key for key in missing_keys if ".lora_" in key]
    if missing:
        raise UserError(f"the adapter '{name}' lacks weights for what it targets, e.g. {missing[0]}",
                        hint="its weight file may be incomplete")


__all__ = ["Adapter", "SEPARATOR", "apply_adapter", "resolve_adapter", "split_model"]
