"""Ports a process is about to listen on: a taken one is one clear error before start-up."""

from __future__ import annotations

import socket

from gemq.errors import GemqError


def check_port_free(host: str, port: int, hint: str) -> None:
    """Raise a GemqError naming ``host:port`` and ``hint`` if nothing could listen there.

    Bound as uvicorn binds (SO_REUSEADDR), so a port left in TIME_WAIT by a restart passes.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise GemqError(f"cannot listen on {host}:{port}: {e.strerror} ({hint})") from None
