"""A model in one GGUF file (llama.cpp's format), as ``--model path/to/model.gguf``.

Contract:

- :func:`is_gguf` tells a GGUF checkpoint by its name (``.gguf``, any case); only the resolver
  (:func:`refusion_cli.models.checkpoint.kind_of`) asks, every later step reads its record's kind.
  :func:`resolve_gguf` turns the name into the file's absolute path, or one :class:`UserError` line when there
  is no such file.
- :func:`read_gguf` calls one of transformers' checkpoint readers on the file, passing the folder and
  ``gguf_file=`` as transformers wants them: transformers reads the config, the tokenizer (vocabulary, merges,
  special tokens, chat template) and the weights (dequantised) from the file with the ``gguf`` package. No
  ``gguf`` package, an architecture transformers cannot read from GGUF, or a damaged file is one line.
- :func:`gguf_fingerprint`: what identifies the file's content for ``refusion eval``'s journal.
- A GGUF file holds a plain causal model: only the AR decoder runs it (the fit check and the loader raise
  :func:`mask_decoder_error` for any other). Nothing else about it differs: the caller finds the EOS, padding
  and stop ids as for any checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refusion_cli.errors import UserError

SUFFIX = ".gguf"
HEADER_BYTES = 1 << 20  # what the fingerprint hashes: the header (metadata, vocabulary, tensor index) comes first


def is_gguf(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF file (by its suffix; it need not exist)."""
    return Path(name_or_path).suffix.lower() == SUFFIX


def resolve_gguf(name_or_path: str) -> str:
    """The absolute path of the GGUF file ``name_or_path``; a UserError when it is not a file."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise UserError(f"no such GGUF file: '{name_or_path}'",
                        hint="--model takes a checkpoint directory, a hub id, or the path of a .gguf file")
    return str(path.resolve())


def mask_decoder_error(name: str, decoder: str | None = None) -> UserError:
    which = f"the {decoder} decoder" if decoder else "a diffusion decoder"
    return UserError(f"'{name}' is a GGUF file, which holds a plain causal model without a mask token; "
                     f"{which} needs one", hint="run it with the AR decoder (--decoder ar)")


def gguf_fingerprint(path: Path) -> str:
    """What identifies a GGUF file's content: its resolved path, the sha256 of its first MiB (the header, and
    all of a small file) and its size and mtime, as a checkpoint folder's weight files are named."""
    with path.open("rb") as file:
        header = hashlib.sha256(file.read(HEADER_BYTES)).hexdigest()
    stat = path.stat()
    return f"{path.resolve()}|{header}|{path.name}:{stat.st_size}:{stat.st_mtime_ns}"


def read_gguf(read: Callable[..., Any], path: str, name: str, **kwargs: Any) -> Any:
    """``read`` (one of transformers' checkpoint readers: ``PreTrainedConfig.get_config_dict``,
    ``AutoTokenizer.from_pretrained``, a model class's ``from_pretrained``) on the GGUF file at the absolute
    ``path``, from its folder with ``gguf_file=``; a failure is one line that names the file as given (``name``)."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading the GGUF file '{name}' needs the gguf package, which is not installed",
                        hint="pip install gguf")
    file = Path(path)
    try:
        return read(str(file.parent), gguf_file=file.name, **kwargs)
    except Exception as exc:  # gguf and transformers raise many kinds for a damaged or unsupported file
        lines = str(exc).strip().splitlines()
        raise UserError(f"cannot read the GGUF file '{name}': {lines[0] if lines else type(exc).__name__}",
                        hint="check that the file is complete (its download finished) and that transformers "
                             "supports its architecture") from exc
