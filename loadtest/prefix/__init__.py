"""`python -m loadtest.prefix` (and `microturn bench --prefix`): the prefix-cache benchmark (issue #33).

Sessions that open with the same P-token prefix (an application's instructions), with the cache on
against the cache off, both engines in one process and their turns interleaved, so a busy machine
slows both sides alike (the ratios are the figures; docs/benchmarks.md "Prefix cache"):

- `first_turn` (first_turn.py): the first turn of a session whose prefix is cached, against a warm
  micro-turn of the same size and against the full prefill the cache off pays;
- `pages` (pages.py): the device pages 64 sessions with 256-token tails hold, and how many such
  sessions a fixed pool keeps open without parking or dropping anything;
- `hot_path` (hot_path.py): the micro-turn median of sessions sharing a prefix against the same
  sessions with the cache off (the per-chunk path pays nothing for the sharing);
- `placement` (placement.py): two workers, two applications' sessions in random order: the cache
  hit rate with and without placement preferring a worker that holds the session's prefix.

runner.py parses the flags, runs the chosen scenarios and prints and writes the figures.
"""
