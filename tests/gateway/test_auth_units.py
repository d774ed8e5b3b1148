"""The pure pieces of auth: where a credential is read from, negotiation around it, limits, settings.

The Redis-backed parts (key store, slots, tokens) are exercised on a real server in test_auth.py.
"""

from __future__ import annotations

import logging

import pytest

from gateway.app import _warn_if_open
from gateway.auth.api_keys import (
    API_KEY_PREFIX,
    ApiKey,
    ms_until_next_day,
    new_secret,
    usage_day,
)
from gateway.auth.credentials import bearer_credential
from gateway.auth.keys import build_parser
from gateway.handshake import BEARER_SUBPROTOCOL_PREFIX, negotiate
from microturn.stack import Stack, StackOptions
from shared.client.core import handshake_headers
from shared.protocol.codec import Encoding, decode_server, encode_server
from shared.protocol.key_limits import KeyLimits
from shared.protocol.messages import SessionExpiring
from shared.settings import GatewaySettings, is_loopback_host, parse_settings
from shared.store.values import sha256_hex

TOKEN = "mtb_abc-DEF_123"


def test_authorization_header_wins_and_scheme_is_case_insensitive() -> None:
    offered = [Encoding.JSON.subprotocol, BEARER_SUBPROTOCOL_PREFIX + TOKEN]
    assert bearer_credential({"authorization": "Bearer mt_key"}, offered) == "mt_key"
    assert bearer_credential({"authorization": "bearer   mt_key "}, []) == "mt_key"
    assert bearer_credential({}, offered) == TOKEN
    assert bearer_credential({"authorization": "Basic dXNlcjpwYXNz"}, []) is None
    assert bearer_credential({"authorization": "Bearer "}, [BEARER_SUBPROTOCOL_PREFIX]) is None
    assert bearer_credential({}, [Encoding.MSGPACK.subprotocol]) is None
    # OpenAI's browser SDK offers its key (here a client secret) this way.
    assert bearer_credential({}, ["realtime", "openai-insecure-api-key." + TOKEN]) == TOKEN


@pytest.mark.parametrize(
    ("offered", "encoding", "echoed"),
    [
        (
            [Encoding.MSGPACK.subprotocol, BEARER_SUBPROTOCOL_PREFIX + TOKEN],
            Encoding.MSGPACK,
            "microturn.v1.msgpack",
        ),
        ([BEARER_SUBPROTOCOL_PREFIX + TOKEN, Encoding.JSON.subprotocol], Encoding.JSON, "microturn.v1.json"),
        # Only the bearer: no microturn subprotocol (the OpenAI dialect), nothing echoed.
        ([BEARER_SUBPROTOCOL_PREFIX + TOKEN], Encoding.JSON, None),
    ],
)
def test_the_bearer_subprotocol_is_never_negotiated_or_echoed(
    offered: list[str], encoding: Encoding, echoed: str | None
) -> None:
    negotiated = negotiate(offered)
    assert negotiated is not None
    assert negotiated.encoding is encoding and negotiated.subprotocol == echoed


def test_bearer_plus_unknown_subprotocol_is_still_refused() -> None:
    assert negotiate(["chat.v2", BEARER_SUBPROTOCOL_PREFIX + TOKEN]) is None


def test_secrets_are_random_prefixed_and_stored_as_sha256() -> None:
    one, two = new_secret(API_KEY_PREFIX), new_secret(API_KEY_PREFIX)
    assert one != two and one.startswith("mt_") and len(one) > 40
    assert len(sha256_hex(one)) == 64 and sha256_hex(one) != sha256_hex(two) and one not in sha256_hex(one)


def test_limits_round_trip_and_refuse_negatives() -> None:
    limits = KeyLimits(max_sessions=2, chunks_per_s=5.5, max_session_s=60.0, max_tokens_per_day=1000)
    assert KeyLimits.from_fields(limits.to_fields()) == limits
    with pytest.raises(ValueError):
        KeyLimits(max_sessions=-1)
    with pytest.raises(ValueError):
        KeyLimits(max_tokens=-5)
    # A record written before a limit existed reads back with that limit off; types come from the field.
    assert KeyLimits.from_fields({"max_sessions": "2", "chunks_per_s": "1.5"}) == KeyLimits(2, 1.5)


def test_the_keys_cli_has_a_flag_for_every_limit() -> None:
    parser = build_parser()
    args = parser.parse_args(["create", "--name", "k", "--max-sessions", "3", "--max-session-s", "9.5"])
    assert (args.max_sessions, args.max_session_s, args.max_tokens_per_day) == (3, 9.5, 0)
    for name in KeyLimits.names(key=True):  # all but a browser token's own (`token_only`)
        assert hasattr(args, name)


def test_a_token_never_outlives_its_key() -> None:
    key = ApiKey("k", "d" * 64, KeyLimits(max_session_s=30.0), 0).limits
    asked = KeyLimits(max_session_s=3600.0, max_tokens=10)
    assert asked.capped_by(key) == KeyLimits(max_session_s=30.0, max_tokens=10)
    assert KeyLimits(max_session_s=5.0).capped_by(key) == KeyLimits(max_session_s=5.0)
    assert KeyLimits().capped_by(key) == KeyLimits(max_session_s=30.0)
    unlimited = ApiKey("k", "d" * 64, KeyLimits(), 0).limits
    assert KeyLimits(max_session_s=12.0).capped_by(unlimited) == KeyLimits(max_session_s=12.0)


def test_daily_budget_renews_at_utc_midnight() -> None:
    noon = 1_700_000_000 - 1_700_000_000 % 86400 + 12 * 3600
    assert ms_until_next_day(noon) == 12 * 3600 * 1000
    assert usage_day(noon) != usage_day(noon + 12 * 3600)


def test_expiring_event_round_trips_in_both_encodings() -> None:
    for message in (
        SessionExpiring("s1", "max_duration", expires_in_ms=5000),
        SessionExpiring("s1", "token_budget", tokens_left=7),
    ):
        for encoding in Encoding:
            assert decode_server(encode_server(message, encoding), encoding) == message


def test_client_sends_the_key_as_a_bearer_header() -> None:
    assert handshake_headers(None, None) is None
    assert handshake_headers({"X-A": "1"}, "mt_k") == {"X-A": "1", "Authorization": "Bearer mt_k"}


def test_auth_setting_defaults_on_and_only_takes_on_or_off() -> None:
    assert GatewaySettings().auth_required
    assert not parse_settings(GatewaySettings, ["--auth", "off"], "gw").auth_required
    with pytest.raises(SystemExit):  # a usage error naming the value (shared/settings.py)
        parse_settings(GatewaySettings, ["--auth", "maybe"], "gw")
    with pytest.raises(ValueError, match="auth: 'maybe' is not one of on, off"):
        GatewaySettings(auth="maybe")


def test_up_turns_auth_off_only_on_loopback() -> None:
    assert Stack(StackOptions(host="127.0.0.1")).auth == "off"
    assert Stack(StackOptions(host="::1")).auth == "off"
    assert Stack(StackOptions(host="0.0.0.0")).auth == "on"
    assert Stack(StackOptions(host="0.0.0.0", auth="off")).auth == "off"
    assert is_loopback_host("localhost") and not is_loopback_host("10.0.0.5")


def test_auth_off_on_a_public_address_warns_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        _warn_if_open(GatewaySettings(host="127.0.0.1", auth="off"))
        _warn_if_open(GatewaySettings(host="0.0.0.0", auth="on"))
        assert not caplog.records
        _warn_if_open(GatewaySettings(host="0.0.0.0", auth="off"))
    assert len(caplog.records) == 1 and "AUTH IS OFF" in caplog.records[0].getMessage()
