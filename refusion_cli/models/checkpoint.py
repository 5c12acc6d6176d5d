"""What one ``--model`` value names, worked out once: the value as typed -> one frozen :class:`Checkpoint`.

A ``--model`` value is an embedded model's name (``refusion-tiny``), a local checkpoint folder, a GGUF file
(``*.gguf``) or a hub id (``org/name``), with or without a LoRA adapter (``ADAPTER_DIR`` or ``BASE+ADAPTER``,
:mod:`refusion_cli.models.adapters`). :func:`resolve_checkpoint` decides which once, the way huggingface_hub
resolves a repository reference into one record before any file is fetched:

1) locate  the kind and where the files are (:func:`locate`; :func:`kind_of` is the one place that tells the
           kinds apart): a local folder comes before an embedded name of the same name, as in
           ``from_pretrained``; a hub id is pinned to the commit its default branch points to (asked of the hub
           when it answers, else read from the local cache), and every file is then read at that commit;
2) read    ``config.json`` once (a GGUF file's metadata: transformers reads it from the file); the family,
           LLaDA's or Dream's layout (:mod:`refusion_cli.models.layouts`), causal or bidirectional, shifted
           logits; an adapter's ``adapter_config.json`` once;
3) record  the fingerprint of the files (below) and the label of report rows (:func:`checkpoint_label`).

Every later step reads the record, and none goes back to the string: the fit check and the loader
(:mod:`refusion_cli.models.loading`), ``refusion eval``'s journal key, the reports. A missing or unusable
checkpoint is one ``UserError`` line here, before any weights load.

The fingerprint names the files a journaled sample was decoded from:

- an embedded model or a local folder: the folder's resolved path, the sha256 of its ``config.json`` and each
  weight file's name, size and mtime (byte for byte what ``paths.folder_fingerprint`` has always given, so
  earlier runs' journals resume);
- a GGUF file: its resolved path, the sha256 of its first MiB and its size and mtime (``gguf.gguf_fingerprint``);
- a hub id: ``org/name@<commit>``. An id is never its own fingerprint: one whose commit is unknown (the hub
  unreachable, the local cache without it) cannot be read either, and is refused at step 1 saying so;
- with an adapter: the base's, ``+``, the adapter's (its folder's as above, or ``org/name@<commit>``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from refusion_cli.errors import UserError
from refusion_cli.models import gguf
from refusion_cli.models.adapters import Adapter, resolve_adapter, split_model
from refusion_cli.models.hub import is_hub_id, offline_unless_hub_answers, pinned_revision
from refusion_cli.models.layouts import NativeLayout, native_layout

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED = ("refusion-tiny", "ar-tiny", "mdm-tiny")  # shipped in refusion_cli/assets/<name>/
DEFAULT_MODEL = "refusion-tiny"
CONFIG_FILE = "config.json"
# what a checkpoint's broken files or its own code raise while loading
LOAD_ERRORS = (OSError, ValueError, KeyError, AttributeError, TypeError, RuntimeError, ImportError, NotImplementedError)


class Kind(str, Enum):  # enum.StrEnum is Python 3.11's; the package runs on 3.10
    EMBEDDED = "embedded"  # shipped in refusion_cli/assets/<name>/
    FOLDER = "folder"  # a local checkpoint folder
    GGUF = "gguf"  # one llama.cpp file: config, tokenizer and weights (models.gguf)
    HUB = "hub"  # a hub id, read through the local Hugging Face cache

    def __str__(self) -> str:  # the value, as StrEnum prints and formats it
        return self.value


@dataclass(frozen=True)
class Location:
    """Where the files of a checkpoint (or a tokenizer) are; no file has been read."""

    name: str  # the value as typed
    kind: Kind
    source: str  # what transformers' readers take: the folder, the GGUF file's absolute path, or the hub id
    local_only: bool  # read local files only: everything but a hub id while the hub answers
    revision: str | None  # a hub id's commit, every file read at it; None for local files

    def read(self, reader: Callable[..., Any], **kwargs: Any) -> Any:
        """``reader`` (one of transformers' ``from_pretrained``, ``get_config_dict``) on these files: a GGUF file
        from its folder with ``gguf_file=``, a hub id at its pinned commit, local files only where located so."""
        if self.kind is Kind.GGUF:
            return gguf.read_gguf(reader, self.source, self.name, local_files_only=True, **kwargs)
        pinned = {"revision": self.revision} if self.revision is not None else {}
        return reader(self.source, local_files_only=self.local_only, **pinned, **kwargs)


@dataclass(frozen=True)
class Checkpoint(Location):
    """A checkpoint as every step after planning knows it: where it is, what its config says, its adapter,
    what identifies its files, its label."""

    config: Any  # the transformers config the weights load with (a layout's stock config for LLaDA and Dream)
    family: str  # config.json's model_type ("qwen3", "llada", "dream", ...)
    remote: bool  # loads with the modelling code shipped with the checkpoint (trust_remote_code)
    bidirectional: bool  # a masked-diffusion model (LLaDA, Dream, remote code, or config.is_causal False)
    shifted: bool | None  # reads token i from position i-1 (Dream) or not (LLaDA); None: not recorded
    layout: NativeLayout | None  # LLaDA or Dream, loaded onto a stock class (models.layouts)
    adapter: Adapter | None  # a LoRA adapter put into the model after its weights load
    fingerprint: str  # what identifies the files (module docstring): refusion eval's journal key
    base_fingerprint: str  # the base's part of it (without the adapter's): what its tokenizer loads from
    label: str  # the short name in report rows (checkpoint_label)


def embedded_path(name: str) -> Path:
    return ASSETS / name


def is_embedded(name: str) -> bool:
    """Whether ``name`` means a shipped model: one of EMBEDDED, and no local path of that name."""
    return name in EMBEDDED and not Path(name).expanduser().exists()


def kind_of(name: str) -> Kind | None:
    """What ``name`` names, from the string and what exists locally (nothing is read): a ``.gguf`` name is a GGUF
    file, then a shipped name without a local path of that name, then any local path, then ``org/name`` a hub id;
    None: anything else (a path that does not exist)."""
    if gguf.is_gguf(name):
        return Kind.GGUF
    if is_embedded(name):
        return Kind.EMBEDDED
    if Path(name).expanduser().exists():
        return Kind.FOLDER
    return Kind.HUB if is_hub_id(name) else None


def checkpoint_label(name: str) -> str:
    """The checkpoint's short name in report rows (``decoder:label``), from the value alone: an embedded name, else
    the last part of the path or id; a local folder named like an embedded model keeps its path, so the two never
    share a label."""
    short = name if is_embedded(name) else Path(name.rstrip("/")).name or name
    if short in EMBEDDED and not is_embedded(name):
        short = name.rstrip("/") if "/" in name.rstrip("/") else f"./{short}"
    return short


def locate(name: str) -> Location:
    """Step 1: the kind of ``name`` and where its files are (a hub id pinned to one commit)."""
    kind = kind_of(name)
    if kind is Kind.GGUF:
        return Location(name, kind, gguf.resolve_gguf(name), True, None)
    if kind is Kind.EMBEDDED:
        path = embedded_path(name)
        if not (path / CONFIG_FILE).is_file():
            raise UserError(f"the embedded model '{name}' is not built in this checkout ({path} is missing)",
                            hint="rebuild the embedded models with `make models` (see docs/training.md, "
                                 "'The embedded models')")
        return Location(name, kind, str(path), True, None)
    if kind is Kind.FOLDER:
        return Location(name, kind, str(Path(name).expanduser()), True, None)
    if kind is None:
        raise UserError(f"no such checkpoint directory: '{name}'",
                        hint=f"give a local directory, a hub id such as GSAI-ML/ReFusion, or one of "
                             f"{', '.join(EMBEDDED)}")
    local_only = offline_unless_hub_answers()
    try:
        revision = pinned_revision(name, local_only)
    except Exception as exc:  # the hub's refusal: no such repository, gated, no access
        raise UserError(f"cannot get '{name}' from the model hub: {first_line(exc)}") from exc
    if revision is None:
        raise _not_cached(name) if local_only else UserError(
            f"cannot get '{name}' from the model hub: the commit of its default branch is unknown")
    return Location(name, kind, name, local_only, revision)


def resolve_checkpoint(name: str, trust_remote_code: bool = False) -> Checkpoint:
    """Steps 1-3 (module docstring): the record of ``--model name``; a missing or unusable checkpoint, or one
    that needs its authors' code without ``trust_remote_code``, is a UserError before any weights load."""
    base, adapter_name = split_model(name)
    adapter = None if adapter_name is None else resolve_adapter(adapter_name)
    base_from_adapter = base is None
    if base is None:  # an adapter folder alone (split_model names a checkpoint, an adapter or both)
        assert adapter is not None
        base = adapter.base
    if adapter is not None and kind_of(base) is Kind.GGUF:
        raise UserError(f"--model {name}: an adapter cannot go on a GGUF file")
    try:
        location = locate(base)
        raw, config_bytes = read_config(location)
        config, family, remote, layout = stock_config(location, raw, trust_remote_code)
    except UserError as exc:
        if not base_from_adapter:
            raise
        raise UserError(f"the adapter '{adapter_name}' is for '{base}', which cannot be loaded: {exc}",
                        hint=f"give the base with it: --model BASE+{adapter_name}") from exc
    base_fingerprint = files_fingerprint(location, config_bytes)
    fingerprint = base_fingerprint if adapter is None else base_fingerprint + "+" + adapter_fingerprint(adapter)
    bidirectional = layout is not None or remote or not getattr(config, "is_causal", True)
    shifted = layout.shifted if layout is not None else getattr(config, "shifted_logits", None)
    return Checkpoint(name, location.kind, location.source, location.local_only, location.revision, config=config,
                      family=family, remote=remote, bidirectional=bidirectional, shifted=shifted, layout=layout,
                      adapter=adapter, fingerprint=fingerprint, base_fingerprint=base_fingerprint,
                      label=checkpoint_label(name))


def read_config(location: Location) -> tuple[dict[str, Any], bytes | None]:
    """Step 2: ``config.json`` as a dict, and its bytes (None for a GGUF file, whose metadata transformers reads);
    no config class is built, no code runs."""
    if location.kind is Kind.GGUF:
        from transformers import PretrainedConfig

        raw, _ = location.read(PretrainedConfig.get_config_dict)
        return raw, None
    path = _hub_config(location) if location.kind is Kind.HUB else Path(location.source) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"'{location.name}' is a local path but holds no {CONFIG_FILE}: not a checkpoint directory")
    try:
        data = path.read_bytes()
        raw = json.loads(data)
    except OSError as exc:
        raise UserError(f"cannot read the config of '{location.name}': {exc.strerror or exc}") from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UserError(f"cannot read the config of '{location.name}': its {CONFIG_FILE} is not valid JSON "
                        f"({first_line(exc)})") from exc
    if not isinstance(raw, dict):
        raise UserError(f"cannot read the config of '{location.name}': its {CONFIG_FILE} is not a JSON object")
    return raw, data


def _hub_config(location: Location) -> Path:
    """The hub id's ``config.json`` at its pinned commit, from the local cache (downloaded first when the hub
    answers)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(location.source, CONFIG_FILE, revision=location.revision,
                                    local_files_only=location.local_only))
    except LocalEntryNotFoundError as exc:
        raise _not_cached(location.name) from exc
    except Exception as exc:  # huggingface_hub raises many kinds (no such file, gated, no access)
        raise UserError(f"cannot read the config of '{location.name}': {first_line(exc)}") from exc


def _not_cached(name: str) -> UserError:
    return UserError(f"'{name}' is not a local directory, the model hub is unreachable, and it is not in the local "
                     "cache", hint="download it on a machine with access and pass the directory, or set HF_HOME to "
                                   "a cache holding it")


def stock_config(location: Location, raw: dict[str, Any],
                 trust_remote_code: bool) -> tuple[Any, str, bool, NativeLayout | None]:
    """(config, family, remote, layout) from ``config.json``'s dict: LLaDA and Dream get their layout's stock
    config, a model type transformers knows gets transformers' own config class, any other with an ``auto_map``
    its own (read by transformers with ``trust_remote_code``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = location.name
    family = str(raw.get("model_type") or "")
    layout = native_layout(family)
    if layout is not None:
        return layout.build_config(raw, name), family.lower(), False, layout
    remote = bool(raw.get("auto_map")) and family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if remote and not trust_remote_code:
        raise UserError(f"'{name}' is a '{family}' checkpoint that needs its authors' modelling code",
                        hint="pass --trust-remote-code (trust_remote_code=True) to run it")
    if not remote and family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"'{name}' is a '{family}' checkpoint, not a causal language model")
    if remote and not {"AutoModelForCausalLM", "AutoModel"} & set(raw["auto_map"]):
        raise UserError(f"'{name}' maps no model class in its config's auto_map "
                        f"(it lists {', '.join(sorted(raw['auto_map']))})",
                        hint="its auto_map needs an AutoModelForCausalLM or AutoModel entry")
    return (_remote_config(location) if remote else _known_config(raw, name)), family, remote, None


def _known_config(raw: dict[str, Any], name: str) -> Any:
    """The config class transformers has for the model type, from the dict read (as ``AutoConfig`` builds it)."""
    from transformers import CONFIG_MAPPING

    model_type = raw["model_type"]
    if model_type == "mistral" and "layer_types" in raw:  # AutoConfig's reading of Ministral's config
        model_type = "ministral"
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(raw))
    except LOAD_ERRORS as exc:
        raise UserError(f"cannot read the config of '{name}': {first_line(exc)}") from exc


def _remote_config(location: Location) -> Any:
    """The checkpoint's own config class, run by transformers (remote code)."""
    from transformers import AutoConfig

    try:
        return location.read(AutoConfig.from_pretrained, trust_remote_code=True)
    except LOAD_ERRORS as exc:  # a checkpoint's own configuration code failing
        raise UserError(f"cannot read the config of '{location.name}': {first_line(exc)}",
                        hint="its configuration code may be written for another transformers release") from exc


def files_fingerprint(location: Location, config_bytes: bytes | None) -> str:
    """Step 3: what identifies the checkpoint's files (module docstring)."""
    if location.kind is Kind.HUB:
        return f"{location.source}@{location.revision}"
    if location.kind is Kind.GGUF:
        return gguf.gguf_fingerprint(Path(location.source))
    folder = Path(location.source)
    return _folder_fingerprint(folder, config_bytes,
                              sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")))


def adapter_fingerprint(adapter: Adapter) -> str:
    """What identifies an adapter's files: its commit on the hub, else its folder's as a checkpoint folder's."""
    if adapter.revision is not None:
        return f"{adapter.name}@{adapter.revision}"
    return _folder_fingerprint(adapter.folder, adapter.config_sha256, adapter.weights)


def _folder_fingerprint(folder: Path, config: bytes | str | None, weight_files: list[Path]) -> str:
    """``paths.folder_fingerprint`` from the config already read (its bytes or their sha256), so that the file is
    opened once: the folder's resolved path, the config's sha256, each weight file's name, size and mtime."""
    parts = [str(folder.resolve())]
    if config is not None:
        parts.append(config if isinstance(config, str) else hashlib.sha256(config).hexdigest())
    for weights in weight_files:
        if weights.is_file():
            stat = weights.stat()
            parts.append(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


__all__ = ["ASSETS", "CONFIG_FILE", "Checkpoint", "DEFAULT_MODEL", "EMBEDDED", "LOAD_ERRORS", "Kind", "Location",
           "checkpoint_label", "embedded_path", "first_line", "is_embedded", "kind_of", "locate", "resolve_checkpoint"]
