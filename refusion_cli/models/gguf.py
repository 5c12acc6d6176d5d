"""A model in one GGUF file (llama.cpp's format), as ``--model path/to/model.gguf``.

Contract:

- :func:`is_gguf` tells a GGUF checkpoint by its name (``.gguf``, any case); :func:`resolve_gguf` turns it into
  the file's absolute path, or one :class:`UserError` line when there is no such file.
- :func:`read_checkpoint` calls one of transformers' checkpoint readers for any source; for a GGUF file it passes
  the folder and ``gguf_file=`` as transformers wants them: transformers reads the config, the tokenizer (vocabulary,
  merges, special tokens, chat template) and the weights (dequantised) from the file with the ``gguf`` package.
  No ``gguf`` package, an architecture transformers cannot read from GGUF, or a damaged file is one line.
- A GGUF file holds a plain causal model: only the AR decoder runs it (:func:`check_gguf_decoder`,
  :func:`mask_decoder_error`). Nothing else about it differs: the caller finds the EOS, padding and stop
  ids as for any checkpoint.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.errors import UserError

SUFFIX = ".gguf"


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


def check_gguf_decoder(decoder: str, name: str) -> None:
    """Only the AR decoder runs a GGUF model: a decoder that needs a mask token is refused before anything loads."""
    if is_gguf(name) and decoder_spec(decoder).needs_mask:
        raise mask_decoder_error(name, decoder)


def read_checkpoint(read: Callable[..., Any], source: str, name: str, **kwargs: Any) -> Any:
    """``read(source, **kwargs)``, where ``read`` is one of transformers' checkpoint readers
    (``AutoConfig.from_pretrained``, ``AutoTokenizer.from_pretrained``, a model class's ``from_pretrained``,
    ``PretrainedConfig.get_config_dict``); for a GGUF file (``source`` its absolute path) from its folder with
    ``gguf_file=``, a failure being one line that names the file."""
    if not is_gguf(source):
        return read(source, **kwargs)
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading the GGUF file '{name}' needs the gguf package, which is not installed",
                        hint="pip install gguf")
    path = Path(source)
    try:
        return read(str(path.parent), gguf_file=path.name, **kwargs)
    except Exception as exc:  # gguf and transformers raise many kinds for a damaged or unsupported file
        lines = str(exc).strip().splitlines()
        raise UserError(f"cannot read the GGUF file '{name}': {lines[0] if lines else type(exc).__name__}",
                        hint="check that the file is complete (its download finished) and that transformers "
                             "supports its architecture") from exc
