"""Gloo ranks on this machine: a free TCP port for their rendezvous (`MASTER_PORT`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no process listens on now (the OS picks it); the spawned ranks' store binds it next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
