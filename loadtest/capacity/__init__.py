"""`microturn bench --capacity`: how many realtime sessions one worker carries (docs/design.md section 9).

The load itself is `loadtest/locustfile.py`, run by Locust in its own process (gevent stays there);
this package holds what that user shares with the benchmark (the workload and the chunk
bookkeeping, no Locust import) and the benchmark that steps Locust against a real stack.
"""
