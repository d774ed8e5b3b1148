"""`python -m loadtest.long_session` (and `microturn bench --long-session`): the long-session benchmark.

Four scenarios, one file each (issue #24, docs/benchmarks.md "Long sessions"):

- `host` (host.py): a turn resumed from the host KV tier vs one that recomputes its history vs a
  warm one, for sessions of several lengths;
- `overflow` (overflow.py): a session with `truncate` running far past its context limit, with
  `retention_ratio` 0.8 and 1.0 (the old cliff), a second session streaming beside it;
- `open` (open_sessions.py): a device pool holding N sessions keeps 8N open, none recomputed;
- `soak` (soak.py): 20,000 micro-turns on one session through a real stack (Redis, a worker, a
  gateway as processes): turn time, worker RSS and the session's Redis bytes over time.

runner.py parses the flags, runs the chosen scenarios and prints and writes the figures.
"""
