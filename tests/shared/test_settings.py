from __future__ import annotations

import pytest

from shared.settings import (
    DEFAULT_MODEL,
    ChatSettings,
    GatewaySettings,
    UpSettings,
    WorkerSettings,
    from_sources,
    parse_settings,
)


def test_flags_override_environment_which_overrides_defaults() -> None:
    import argparse

    from shared.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings)
    args = parser.parse_args(["--port", "9001", "--model", "tiny"])
    env = {"MT_PORT": "9000", "MT_MAX_SESSIONS": "7", "MT_REDIS_URL": "redis://h:1/0"}
    settings = from_sources(WorkerSettings, args, env)
    assert (settings.port, settings.model, settings.max_sessions) == (9001, "tiny", 7)
    assert settings.redis_url == "redis://h:1/0"
    assert settings.heartbeat_s == WorkerSettings().heartbeat_s


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="MT_MAX_FRAME_BYTES"):
        from_sources(GatewaySettings, None, {"MT_MAX_FRAME_BYTES": "lots"})
    with pytest.raises(SystemExit):
        parse_settings(GatewaySettings, ["--no-such-flag"], "microturn gateway")


def test_an_environment_value_outside_a_fields_choices_is_refused_as_its_flag_would_be() -> None:
    # argparse checks a flag's choices; the same list holds for the variable, before any load.
    with pytest.raises(ValueError, match="MT_WEIGHTS: 'int3' is not one of auto, float, int8, int4"):
        from_sources(WorkerSettings, None, {"MT_WEIGHTS": "int3"})
    assert from_sources(WorkerSettings, None, {"MT_WEIGHTS": "int4"}).weights == "int4"


def test_a_bad_environment_value_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in (("MT_KV_TOKENS", "abc"), ("MT_KV_DTYPE", "float8"), ("MT_REBALANCE_GAP", "1")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(SystemExit) as exited:
                parse_settings(WorkerSettings, [], "microturn worker")
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "microturn worker: error:" in err and value in err and "Traceback" not in err


def test_a_redis_url_redis_py_cannot_dial_is_refused_naming_only_its_scheme() -> None:
    for url, mode, said in (
        ("bogus://:secret@h:1/0", "standalone", "bogus:// is not redis:// or rediss:// or unix://"),
        ("127.0.0.1:6379", "standalone", "a URL with no scheme"),
        ("unix:///run/valkey.sock", "cluster", "unix:// is not redis:// or rediss://"),
    ):
        with pytest.raises(ValueError, match=said) as refused:
            GatewaySettings(redis_url=url, redis_mode=mode)
        assert "secret" not in str(refused.value)
        with pytest.raises(ValueError, match=said):
            UpSettings(redis_url=url, redis_mode=mode)
    assert WorkerSettings(redis_url="unix:///run/valkey.sock").redis_url == "unix:///run/valkey.sock"
    assert GatewaySettings(redis_url="rediss://u:p@h:1/0", redis_mode="cluster").redis_mode == "cluster"


def test_the_engine_runs_with_the_worker_defaults() -> None:
    from worker.engine import EngineConfig

    worker = WorkerSettings()
    config = EngineConfig.from_settings(worker)
    assert config == EngineConfig(model=worker.model)  # one set of defaults: nothing to convert
    assert (config.max_sessions, config.max_chunk_tokens, config.max_output_tokens) == (256, 512, 512)
    # `chat` gets the same engine as a worker with the same flags.
    chat = parse_settings(ChatSettings, ["--max-sessions", "3", "--max-reply-tokens", "9"], "chat")
    assert EngineConfig.from_settings(chat) == EngineConfig.from_settings(WorkerSettings(max_sessions=3))
    assert chat.max_reply_tokens == 9
    assert GatewaySettings().max_chunk_tokens == worker.max_chunk_tokens


def test_the_engine_queue_and_the_gateway_queue_are_set_apart() -> None:
    # One MT_ variable used to set both under `microturn up`: now each names its own role.
    env = {"MT_MAX_QUEUED_TOKENS": "5", "MT_MAX_PENDING_TOKENS": "7"}
    assert from_sources(GatewaySettings, None, env).max_queued_tokens == 5
    assert from_sources(WorkerSettings, None, env).max_pending_tokens == 7
    # The worker's old flag names keep working.
    old_flags = ["--max-queued-tokens", "9", "--max-queued-outputs", "3"]
    worker = parse_settings(WorkerSettings, old_flags, "microturn worker")
    assert (worker.max_pending_tokens, worker.max_pending_outputs) == (9, 3)


def test_up_flags_come_from_its_settings_with_the_same_precedence() -> None:
    import argparse

    from shared.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, UpSettings)
    args = parser.parse_args(["--ready-timeout", "5", "--port", "9001", "--device", "cpu"])  # an old name
    env = {"MT_PORT": "9000", "MT_REDIS_URL": "redis://h:1/0", "MT_WORKER_PORT": "9100"}
    up = from_sources(UpSettings, args, env)
    assert (up.ready_timeout_s, up.port, up.worker_port, up.device) == (5.0, 9001, 9100, "cpu")
    assert up.redis_url == "redis://h:1/0"
    defaults = UpSettings()
    assert (defaults.port, defaults.worker_port) == (GatewaySettings().port, WorkerSettings().port)
    assert defaults.model == WorkerSettings().model == DEFAULT_MODEL
    assert (defaults.redis_url, defaults.auth, defaults.device, defaults.kv_tokens) == (
        None,
        None,
        None,
        None,
    )
    # The stack's one worker has the machine's cores: every step on every thread, unless told otherwise.
    assert defaults.cpu_single_thread_max_tokens == 0 < WorkerSettings().cpu_single_thread_max_tokens
    assert (
        from_sources(
            UpSettings, None, {"MT_CPU_SINGLE_THREAD_MAX_TOKENS": "256"}
        ).cpu_single_thread_max_tokens
        == 256
    )
    with pytest.raises(SystemExit):
        parse_settings(UpSettings, ["--device", "tpu"], "microturn up")
    with pytest.raises(ValueError, match="MT_AUTH: 'maybe' is not one of"):
        from_sources(UpSettings, None, {"MT_AUTH": "maybe"})


def test_copy_fields_takes_same_named_values_and_overrides_win() -> None:
    import argparse

    from shared.settings import copy_fields

    source = argparse.Namespace(port=9001, max_sessions=3, unrelated="x")
    worker = copy_fields(WorkerSettings, source, max_sessions=4)
    assert (worker.port, worker.max_sessions) == (9001, 4)
    assert worker.heartbeat_s == WorkerSettings().heartbeat_s  # absent from the source: the default


def test_benchmark_flags_map_onto_their_configs() -> None:
    from loadtest.bench.config import BenchConfig
    from loadtest.bench.run import main as bench_main
    from loadtest.capacity.config import CapacityConfig
    from loadtest.capacity.run import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args([])) == CapacityConfig()
    tuned = config_from_args(build_parser().parse_args(["--p99-ms", "150", "--chunk-tokens", "8"]))
    assert (tuned.p99_limit_ms, tuned.load.chunk_tokens, tuned.model) == (150.0, 8, BenchConfig().model)
    with pytest.raises(SystemExit):
        bench_main(["--modes", "reprefill"])  # streaming is required: a usage error, as before


def test_the_prefix_cache_switch_is_on_by_default_and_only_on_or_off() -> None:
    from worker.engine import EngineConfig

    assert WorkerSettings().prefix_cache == "on"
    off = parse_settings(WorkerSettings, ["--prefix-cache", "off"], "microturn worker")
    assert EngineConfig.from_settings(off).prefix_cache == "off"
    assert from_sources(WorkerSettings, None, {"MT_PREFIX_CACHE": "off"}).prefix_cache == "off"
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--prefix-cache", "maybe"], "microturn worker")
    with pytest.raises(ValueError, match="prefix_cache"):
        EngineConfig(model="tiny", prefix_cache="maybe")


def test_rebalance_is_off_by_default_and_its_gap_and_period_are_checked() -> None:
    assert WorkerSettings().rebalance_gap == 0  # off: no worker moves a session unless asked to
    on = parse_settings(
        WorkerSettings, ["--rebalance-gap", "4", "--rebalance-period-s", "3"], "microturn worker"
    )
    assert (on.rebalance_gap, on.rebalance_period_s) == (4, 3.0)
    with pytest.raises(ValueError, match="rebalance_gap"):
        WorkerSettings(rebalance_gap=1)  # two workers one apart would trade a session back and forth
    with pytest.raises(ValueError, match="rebalance_gap"):
        WorkerSettings(rebalance_gap=-2)
    with pytest.raises(ValueError, match="rebalance_period_s"):
        WorkerSettings(rebalance_gap=2, heartbeat_s=1.0, rebalance_period_s=1.5)  # under two beats
    WorkerSettings(rebalance_gap=0, heartbeat_s=1.0, rebalance_period_s=1.5)  # off: the period is unused
