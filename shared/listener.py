"""The listening socket a server (the gateway, a worker) binds before it starts anything else, and
the refusal it starts with where it cannot."""

from __future__ import annotations

import socket


class ListenRefused(Exception):
    """The server's address cannot be bound; the message names it and the reason, for the server's
    one-line refusal (exit `EXIT_REFUSED`, shared/settings.py)."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A server's socket, bound now: uvicorn listens on it (`Server.run(sockets=...)`) once the
    app's lifespan is up. `ListenRefused` where the address cannot be bound (a port taken).

    Why a server binds first: a worker whose port was taken used to load its model and register in
    Redis, and only then fail to bind (uvicorn's exit), leaving a brief entry gateways could pick;
    bound first, a taken port is refused before anything starts. The options are uvicorn's own
    (`Config.bind_socket`): an IPv6 family for a host with a colon, SO_REUSEADDR.
    """
    listener = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise ListenRefused(f"cannot listen on {host} port {port}: {exc.strerror}") from exc
    listener.set_inheritable(True)
    return listener
