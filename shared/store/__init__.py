"""The Redis store both sides use: the connection, the key schema and Lua scripts, the registry."""
