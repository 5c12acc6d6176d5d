"""Whether the Hugging Face hub answers: a quick TCP probe, its answer kept for the rest of the process.

A command that may reach the hub (a hub id to load, a benchmark to download) asks here first; when the
hub does not answer within a few seconds (or ``HF_HUB_OFFLINE`` is set) it works from local files only.
What may be a hub id (:func:`is_hub_id`) and the commit a repository's files are read from
(:func:`pinned_revision`) are decided here too, once for checkpoints and adapters.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from urllib.parse import urlparse


def hub_endpoint() -> str:
    """The hub's address: HF_ENDPOINT, else huggingface.co (no trailing slash)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the model hub answers a TCP connection within ``timeout`` seconds (offline mode: False)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    return _probe(hub_endpoint(), timeout)


@lru_cache(maxsize=4)
def _probe(endpoint: str, timeout: float) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def offline_unless_hub_answers() -> bool:
    """For a hub id: False (download) when the hub answers; else True (the local cache only), with
    HF_HUB_OFFLINE set so that no later call waits for the hub either."""
    if hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    return True


def is_hub_id(name: str) -> bool:
    """Whether ``name`` may be a hub id (``org/name``): one slash, and not a path (``.``, ``/`` or ``~`` first)."""
    return not name.startswith((".", "/", "~")) and name.count("/") == 1


def pinned_revision(repo: str, local_only: bool) -> str | None:
    """The commit ``repo``'s default branch points to, which every file of it is then read at: asked of the hub,
    else (``local_only``, or the hub down) the local cache's record of it; None when neither knows.

    The hub's own refusals (no such repository, gated, no access) are raised as huggingface_hub raises them."""
    from huggingface_hub import resolve_revision
    from huggingface_hub.errors import RevisionResolutionError

    try:
        return resolve_revision(repo, local_files_only=local_only).resolved
    except RevisionResolutionError:
        return None
