"""Checkpoint loading: embedded tiny models, local directories, hub ids."""

from refusion_cli.models.loading import DEFAULT_MODEL, EMBEDDED, LoadedModel, load_model

__all__ = ["DEFAULT_MODEL", "EMBEDDED", "LoadedModel", "load_model"]
