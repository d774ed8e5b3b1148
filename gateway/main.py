"""`microturn gateway`: run the gateway app under uvicorn with settings from flags and `MT_*`.

Why uvicorn is configured here and not left to its defaults: the WebSocket frame limit must sit
above `max_frame_bytes`, or uvicorn would drop an oversized frame with a bare 1009 close instead of
letting the gateway answer it with a typed, recoverable `chunk_too_large`; and per-message deflate
is off because micro-turn frames are a few hundred bytes, where compression costs more than it saves.
With `--tls-cert-file`/`--tls-key-file` uvicorn serves https and wss on the same port; the pair is
loaded once before uvicorn starts, so a missing, unreadable or mismatched file stops the gateway at
once with a message naming it, not at the first handshake.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from typing import Final

import uvicorn

from gateway.app import create_app
from shared.listener import ListenRefused, bind_listener
from shared.settings import EXIT_REFUSED, SHUTDOWN_GRACE_S, GatewaySettings, parse_settings

logger = logging.getLogger(__name__)

# Frames up to this multiple of max_frame_bytes are read and refused politely; beyond it the
# transport closes with 1009 (message too big) without buffering them.
_TRANSPORT_FRAME_FACTOR: Final = 4
_MIN_TRANSPORT_FRAME_BYTES: Final = 1 << 20


def tls_problem(settings: GatewaySettings) -> str | None:
    """Why the TLS certificate and key cannot serve, naming the file; None when they can (or no TLS)."""
    if not settings.tls:
        return None
    cert, key = settings.tls_cert_file, settings.tls_key_file
    for flag, path in (("--tls-cert-file", cert), ("--tls-key-file", key)):
        try:
            with open(path, "rb") as file:
                file.read(1)
        except OSError as exc:
            return f"{flag} {path}: cannot be read ({exc.strerror or exc})"
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_verify_locations(cafile=cert)  # parses every certificate in the file
    except (ssl.SSLError, ValueError) as exc:
        return f"--tls-cert-file {cert}: not a PEM certificate ({exc})"
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        return f"--tls-key-file {key}: not the PEM private key of --tls-cert-file {cert} ({exc})"
    return None


def uvicorn_config(settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        lifespan="on",
        ws_max_size=max(settings.max_frame_bytes * _TRANSPORT_FRAME_FACTOR, _MIN_TRANSPORT_FRAME_BYTES),
        ws_per_message_deflate=False,
        log_config=None,  # keep the process's logging setup (microturn/main.py configures it)
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        ssl_certfile=settings.tls_cert_file or None,  # both or neither (GatewaySettings checks)
        ssl_keyfile=settings.tls_key_file or None,
    )


def main(argv: Sequence[str]) -> int:
    settings = parse_settings(GatewaySettings, argv, "microturn gateway")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = tls_problem(settings)
    if problem is not None:
        logger.error("gateway not started: %s", problem)
        return EXIT_REFUSED
    try:
        listener = bind_listener(settings.host, settings.port)
    except ListenRefused as refused:
        logger.error("gateway not started: %s", refused)
        return EXIT_REFUSED
    server = uvicorn.Server(uvicorn_config(settings))
    scheme = "https/wss" if settings.tls else "http/ws"
    logger.info("gateway listening on %s:%d (%s)", settings.host, settings.port, scheme)
    server.run(sockets=[listener])
    # uvicorn reports a failed start (a lifespan error: Redis unreachable) by exiting the serve loop early.
    return 0 if server.started else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
