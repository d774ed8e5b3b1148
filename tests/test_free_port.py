"""`microturn.processes.free_port` never hands out a port twice in one process: two servers started
back to back must not both get a port the first has not bound yet."""

from __future__ import annotations

import socket

from microturn.processes import free_port


def test_ports_handed_out_are_free_and_never_repeated() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # nothing listens on it
