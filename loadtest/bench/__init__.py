"""`microturn bench`: streamed sessions vs re-prefill vs a transformers KV-cache loop (docs/design.md §9).

The point of the bench is one comparison: a session whose KV cache stays resident between
micro-turns pays for its new tokens only, while re-prefilling pays for the whole history every
turn. Every mode replays the same token history (streaming's), so the latencies differ only in
how that history is handled. Entry points: `loadtest.bench.run.run_bench` and `.main`.
"""

from loadtest.bench.config import MODES, BenchConfig

__all__ = ["MODES", "BenchConfig"]
