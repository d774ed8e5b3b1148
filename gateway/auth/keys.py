"""`microturn keys create|list|revoke`: manage API keys in the deployment's Redis.

`create` prints the new key as the last line of its output (and only then: it is never stored, only
its SHA-256 is), so a script can take it with `tail -n 1`. Every sub-command takes `--redis-url` and
`--key-prefix` (or `MT_REDIS_URL`, `MT_KEY_PREFIX`), the same as the gateway they serve.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence

from redis.exceptions import RedisError

from gateway.auth.api_keys import KeyExists, KeyStore
from shared.protocol.key_limits import KeyLimits
from shared.settings import RedisSettings, add_arguments, from_sources
from shared.store.connection import resilient_redis
from shared.store.schema import KeySchema


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microturn keys", description="Manage API keys.")
    common = argparse.ArgumentParser(add_help=False)
    add_arguments(common, RedisSettings)  # a flag wins over MT_REDIS_URL / MT_KEY_PREFIX, as everywhere
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", parents=[common], help="create a key; prints it as the last line")
    create.add_argument("--name", required=True, help="a unique name (what list and revoke use)")
    for limit in dataclasses.fields(KeyLimits):  # one flag per limit a key sets, from the limit itself
        if limit.name not in KeyLimits.names(key=True):
            continue
        kind = float if limit.type in (float, "float") else int
        flag = "--" + limit.name.replace("_", "-")
        create.add_argument(
            flag, type=kind, default=limit.default, help=f"{limit.metadata['help']} (0: no limit)"
        )
    sub.add_parser("list", parents=[common], help="list keys (names and limits, never the keys)")
    revoke = sub.add_parser("revoke", parents=[common], help="revoke a key: its next open is refused")
    revoke.add_argument("name")
    return parser


def _limit(value: float) -> str:
    return "-" if not value else f"{value:g}"


async def _run(args: argparse.Namespace) -> int:
    settings = from_sources(RedisSettings, args)
    redis = resilient_redis(settings.redis_url, settings.redis_mode)
    try:
        store = KeyStore(redis, KeySchema(settings.key_prefix))
        if args.action == "create":
            limits = KeyLimits(**{name: getattr(args, name) for name in KeyLimits.names(key=True)})
            try:
                secret, key = await store.create(args.name, limits)
            except KeyExists as exc:
                sys.stderr.write(f"{exc}\n")
                return 1
            print(f"created key {key.name!r} (shown once; only its SHA-256 is stored):")
            print(secret)
            return 0
        if args.action == "list":
            keys = await store.list()
            names = KeyLimits.names(key=True)
            header = ("name", *names, "used_today")
            rows = [header]
            for key in keys:
                used = await store.usage(key.digest)
                rows.append((key.name, *(_limit(getattr(key.limits, n)) for n in names), str(used)))
            widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
            for row in rows:
                print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
            if not keys:
                print("(no keys: create one with `microturn keys create --name NAME`)")
            return 0
        if await store.revoke(args.name):
            print(f"revoked key {args.name!r}")
            return 0
        sys.stderr.write(f"no key named {args.name!r}\n")
        return 1
    finally:
        await redis.aclose()


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        return asyncio.run(_run(args))
    except ValueError as exc:
        sys.stderr.write(f"microturn keys: {exc}\n")
        return 2
    except (RedisError, OSError) as exc:
        sys.stderr.write(f"microturn keys: cannot use Redis: {exc}\n")
        return 2
