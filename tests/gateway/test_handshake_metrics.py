"""Subprotocol negotiation and the Prometheus text of the gateway metrics."""

from __future__ import annotations

import pytest

from gateway.handshake import Negotiated, negotiate
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from shared.metrics import Histogram
from shared.protocol.codec import Encoding
from shared.protocol.link_client import link_endpoint


@pytest.mark.parametrize(
    ("offered", "expected"),
    [
        ([], Negotiated(Encoding.JSON, None, "openai")),  # nothing offered: the OpenAI dialect (its SDK)
        (["realtime"], Negotiated(Encoding.JSON, "realtime", "openai")),  # OpenAI's browser SDK
        (["realtime", "openai-insecure-api-key.mtb_x"], Negotiated(Encoding.JSON, "realtime", "openai")),
        (["openai-insecure-api-key.mtb_x"], Negotiated(Encoding.JSON, None, "openai")),
        (["realtime", "microturn.v1.json"], Negotiated(Encoding.JSON, "microturn.v1.json")),  # native wins
        (["microturn.v1.msgpack"], Negotiated(Encoding.MSGPACK, "microturn.v1.msgpack")),
        (["x.v9", " microturn.v1.json "], Negotiated(Encoding.JSON, "microturn.v1.json")),
        (["microturn.v1.msgpack", "microturn.v1.json"], Negotiated(Encoding.MSGPACK, "microturn.v1.msgpack")),
        (["microturn.v2.xml"], None),  # only unknown ones: refuse
        (["microturn.v2.xml", "openai-insecure-api-key.mtb_x"], None),
    ],
)
def test_negotiate(offered: list[str], expected: Negotiated | None) -> None:
    assert negotiate(offered) == expected


def test_dialect_counters_render_with_their_label() -> None:
    metrics = GatewayMetrics()
    metrics.count(Metric.DIALECT_SESSIONS, label="openai")
    metrics.count(Metric.DIALECT_TURNS, label="openai")
    metrics.count(Metric.DIALECT_TURNS, label="openai")
    metrics.count(Metric.DIALECT_TURNS, label="native")
    text = metrics.render()
    assert 'microturn_gateway_dialect_sessions_total{dialect="openai"} 1' in text
    assert 'microturn_gateway_dialect_turns_total{dialect="openai"} 2' in text
    assert 'microturn_gateway_dialect_turns_total{dialect="native"} 1' in text


def test_link_endpoint_appends_the_link_path_once() -> None:
    assert link_endpoint("ws://10.0.0.1:8100") == "ws://10.0.0.1:8100/v1/link"
    assert link_endpoint("ws://10.0.0.1:8100/") == "ws://10.0.0.1:8100/v1/link"
    assert link_endpoint("wss://w.example/v1/link") == "wss://w.example/v1/link"


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram([0.01, 0.1])
    for value in (0.005, 0.01, 0.05, 3.0):
        histogram.observe(value)
    assert histogram.render("h") == [
        "# TYPE h histogram",
        'h_bucket{le="0.01"} 2',
        'h_bucket{le="0.1"} 3',
        'h_bucket{le="+Inf"} 4',
        "h_sum 3.065000",
        "h_count 4",
    ]
    with pytest.raises(ValueError):
        Histogram([0.1, 0.01])


def test_metrics_text_has_every_family_once() -> None:
    metrics = GatewayMetrics()
    metrics.set(Metric.SOCKETS_OPEN, 3)
    metrics.count(Metric.CHUNKS_FORWARDED, 7)
    metrics.count(Metric.ERRORS, label="rate_limited")
    metrics.count(Metric.ERRORS, label="rate_limited")
    metrics.turn_latency.observe(0.02)
    text = metrics.render()
    assert "microturn_gateway_sockets_open 3\n" in text
    assert "microturn_gateway_chunks_forwarded_total 7\n" in text
    assert 'microturn_gateway_errors_total{code="rate_limited"} 2\n' in text
    assert 'microturn_gateway_turn_latency_seconds_bucket{le="0.025"} 1\n' in text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    assert text.endswith("\n")
