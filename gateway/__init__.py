"""The stateless WebSocket gateway (docs/design.md sections 1, 3, 5): clients in, worker links out.

Modules, one concern each: `app` (routes, lifespan), `main` (`microturn gateway`, uvicorn),
`handshake` (subprotocol negotiation), `session` (one client socket's session: the Sans-I/O
machine, its asyncio shell `client_session` and the socket's single ordered writer `outbox`),
`session_store` (placement, session records and resume checks in Redis), `links` (one
multiplexed link per worker, routing by session id), `limits` (frame size, tokens per chunk, rate,
in-flight), `metrics` (Prometheus text), `services` (what all sockets of one process share).
"""
