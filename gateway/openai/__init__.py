"""The OpenAI Realtime dialect of `/v1/realtime` (issue #18): the official `openai` SDK's events,
translated per socket into a microturn session underneath (gateway/dialect.py is the seam).

One concern per module: `client_events` (parse and validate what a client sends), `session_config`
(`session.update`: what is acted on, what is kept and echoed), `server_events` (build what it
receives), `conversation` (the items, rendered with the model's chat template into the session's
one KV sequence), `flight` (the chunks in flight) and `pending` (input queued behind a running
response), `admission` (an event admitted whole under the session's one rule), `dialect` (the
per-socket translator), `ids`, `errors`, `connect` (which dialect a handshake gets) and
`client_secrets` (`POST /v1/realtime/client_secrets`).
"""
