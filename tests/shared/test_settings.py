from __future__ import annotations

import pytest

from shared.settings import GatewaySettings, WorkerSettings, from_sources, parse_settings


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
