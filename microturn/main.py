"""The `microturn` command: one entry point, one sub-command per process kind."""

from __future__ import annotations

import logging
import sys


def _up(argv: list[str]) -> int:
    from microturn.stack import main as stack_main

    def announce(url: str) -> None:
        print(f"microturn is up: open {url}  (Ctrl-C stops everything)", flush=True)

    return stack_main(argv, announce=announce)


def _chat(argv: list[str]) -> int:
    from shared.settings import ChatSettings, parse_settings

    settings = parse_settings(
        ChatSettings, argv, "microturn chat", description="Chat with the engine in the terminal."
    )
    from worker.openmp import choose_spin

    choose_spin(shared_cores=settings.cpu_single_thread_max_tokens > 0)
    from shared.settings import EXIT_REFUSED
    from worker.console import chat
    from worker.engine import START_REFUSALS, Engine, EngineConfig

    try:
        engine = Engine.from_config(EngineConfig.from_settings(settings))
    except START_REFUSALS as refused:
        sys.stderr.write(f"microturn chat: error: {refused}\n")
        return EXIT_REFUSED
    with engine:
        chat(engine, max_reply_tokens=settings.max_reply_tokens)
    return 0


def _bench(argv: list[str]) -> int:
    if "--capacity" in argv:
        from loadtest.capacity.run import main as capacity_main

        return capacity_main([arg for arg in argv if arg != "--capacity"])
    if "--gateway-overhead" in argv:
        from loadtest.overhead import main as overhead_main

        return overhead_main([arg for arg in argv if arg != "--gateway-overhead"])
    if "--peer" in argv:
        from loadtest.peer import main as peer_main

        return peer_main(argv)
    if "--long-session" in argv:
        from loadtest.long_session.runner import main as long_session_main

        return long_session_main([arg for arg in argv if arg != "--long-session"])
    if "--prefix" in argv:
        from loadtest.prefix.runner import main as prefix_main

        return prefix_main([arg for arg in argv if arg != "--prefix"])
    from loadtest.bench.run import main as bench_main

    return bench_main(argv)


def _worker(argv: list[str]) -> int:
    from shared.settings import WorkerSettings, parse_settings
    from worker.malloc import reuse_freed_memory
    from worker.openmp import choose_spin

    # Before anything loads torch (worker.server.main does): libgomp reads its spin once.
    settings = parse_settings(WorkerSettings, argv, "microturn worker")
    choose_spin(shared_cores=settings.cpu_single_thread_max_tokens > 0)
    reuse_freed_memory()
    from worker.server.main import serve

    return serve(settings)


def _gateway(argv: list[str]) -> int:
    from gateway.main import main as gateway_main

    return gateway_main(argv)


def _keys(argv: list[str]) -> int:
    from gateway.auth.keys import main as keys_main

    return keys_main(argv)


COMMANDS = {
    "up": _up,
    "chat": _chat,
    "bench": _bench,
    "worker": _worker,
    "gateway": _gateway,
    "keys": _keys,
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        sys.stderr.write(f"usage: microturn {{{','.join(COMMANDS)}}} [options]\n")
        return 0 if args and args[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
