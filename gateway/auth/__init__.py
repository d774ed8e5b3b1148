"""Credentials and per-key limits: API keys, browser tokens, the session's limits, the key ledger,
and `microturn keys` (keys.py), the command that manages the keys."""
