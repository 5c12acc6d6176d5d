"""Checkpoint loading: embedded tiny models, local directories, GGUF files, hub ids, each resolved once into a
record (``checkpoint``) that the fit check and the loader (``loading``) read."""

from refusion_cli.models.checkpoint import Checkpoint, resolve_checkpoint
from refusion_cli.models.loading import DEFAULT_MODEL, EMBEDDED, LoadedModel, load_model

__all__ = ["Checkpoint", "DEFAULT_MODEL", "EMBEDDED", "LoadedModel", "load_model", "resolve_checkpoint"]
