"""The worker process: the engine behind a WebSocket link server, registered in Redis."""
