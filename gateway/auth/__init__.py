"""Credentials and per-key limits: API keys, browser tokens, the session's limits, the key ledger."""
