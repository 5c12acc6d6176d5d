"""A free TCP port for multi-process runs (accelerate launch), so concurrent runs never share one."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
