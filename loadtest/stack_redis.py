"""Which Redis a benchmark's own stack runs on: an embedded Valkey unless `--redis-url` names one.

Why a helper: the capacity and gateway-overhead benchmarks start a stack of their own, and a
deployment sizing itself wants it on the Redis it will run (a Redis Cluster included). The flags
are `microturn up`'s own fields (shared/settings.py `UpSettings`), so their help and choices are
defined once.
"""

from __future__ import annotations

import argparse
import dataclasses

from shared.settings import UpSettings

REDIS_FIELDS = ("redis_url", "redis_mode")


def add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    """`--redis-url` and `--redis-mode`, as `microturn up` takes them."""
    fields = {f.name: f for f in dataclasses.fields(UpSettings)}
    for name in REDIS_FIELDS:
        spec = fields[name]
        parser.add_argument(
            "--" + name.replace("_", "-"),
            default=spec.default,
            help=spec.metadata["help"],
            choices=spec.metadata.get("choices"),
        )
