"""The `microturn` command (main.py), `microturn up` (stack.py) and process supervision (processes.py).

The top floor of the house: it imports the gateway, the worker and the benchmarks it starts, and
nothing below imports it (tests/test_architecture.py).
"""
