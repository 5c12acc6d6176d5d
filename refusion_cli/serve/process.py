"""Running ``refusion serve``'s HTTP server as a process: the address checked before the model loads, uvicorn
run until SIGTERM, Ctrl-C or the scheduler's death, and the lifeline that ends the process when the scheduler
dies, so that a supervisor restarts it."""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
from typing import Any

from refusion_cli.errors import UserError
from refusion_cli.serve.app import ServerState, create_app

log = logging.getLogger("refusion.serve")

EXIT_GRACE_SECONDS = 10  # after the scheduler died: the server's own shutdown, then a hard exit
EXIT_SCHEDULER_DIED = 1


class Lifeline:
    """Ends the server when the scheduler dies (``die`` is the scheduler's ``on_death``): uvicorn is told to
    exit, and should it not within ``EXIT_GRACE_SECONDS``, the process exits anyway; ``reason`` says why."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.server: Any = None  # the uvicorn server, once it runs

    def die(self, reason: str) -> None:
        self.reason = reason
        log.critical("exiting: %s", reason)
        if self.server is not None:
            self.server.should_exit = True
        timer = threading.Timer(EXIT_GRACE_SECONDS, os._exit, (EXIT_SCHEDULER_DIED,))
        timer.daemon = True
        timer.start()


def run_server(state: ServerState, host: str, port: int, lifeline: Lifeline | None = None) -> bool:
    """Serve until SIGTERM, Ctrl-C or the scheduler's death (``lifeline``); False when the server could not
    start (the port taken, say). SIGTERM is a clean stop: uvicorn stops taking connections, lets the open
    ones finish, the scheduler drains (``shutdown_timeout``), and the process exits 0 (uvicorn would raise
    it again)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=math.ceil(state.shutdown_timeout) + 5)
    server = Server(config)
    if lifeline is not None:
        lifeline.server = server
    try:
        server.run()
    except SystemExit:  # uvicorn's way of saying it could not bind (logged above)
        return False
    return server.started


def check_address(host: str, port: int) -> None:
    """Refuse an address the server cannot listen on (a port in use, a host not of this machine) before the
    model loads: one error line rather than minutes of loading first."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}",
                            hint="is the port in use? pick another with --port") from None


__all__ = ["EXIT_GRACE_SECONDS", "EXIT_SCHEDULER_DIED", "Lifeline", "check_address", "run_server"]
