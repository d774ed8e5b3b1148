"""Through `microturn up` with SmolLM2 and the native client: `response_format` on a turn and as the
session's default travels client -> gateway -> link -> engine, the output parses, and a format the
grammar library rejects is a typed error that leaves the seq free (issue 36, points 1, 5 and 7).

On the package's shared `up` (conftest.py), as `microturn up` started with no flags: each encoding
opens sessions of its own, and what a turn's format leaves on the worker (a compiled grammar in its
cache) changes no other session's output."""

from __future__ import annotations

import json

import pytest

from shared.client.clients import SyncRealtimeClient
from shared.errors import InvalidMessage
from shared.protocol.messages import OutputDone
from shared.protocol.response_format import ResponseFormat
from tests.system.e2e.up import Up

pytestmark = pytest.mark.slow

SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}
EOS = "<|im_end|>"


def ask(question: str) -> str:
    return f"<|im_start|>user\n{question}{EOS}\n<|im_start|>assistant\n"


def body(done: OutputDone) -> str:
    """The output's text up to the stop token the grammar ends with."""
    assert done.finish == "stop" and done.text is not None and done.text.endswith(EOS), done
    return done.text[: -len(EOS)]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_json_schema_and_choice_through_the_native_client(smollm2_up: Up, encoding: str) -> None:
    up = smollm2_up
    with SyncRealtimeClient.connect(up.ws, encoding) as client:
        client.open(max_output_tokens=0)
        done = client.turn(
            1,
            text=ask("Describe the capital of France as JSON."),
            max_output_tokens=60,
            response_format=ResponseFormat("json_schema", schema=SCHEMA),
        )
        value = json.loads(body(done))
        assert set(value) == {"city", "population_millions"}
        with pytest.raises(InvalidMessage, match="grammar library"):
            client.turn(
                2,
                text=ask("Again."),
                max_output_tokens=5,
                response_format=ResponseFormat("regex", pattern="(("),
            )
        # The refused chunk consumed nothing: seq 2 is free.
        done = client.turn(
            2,
            text=ask("Is Paris in France? Answer yes or no."),
            max_output_tokens=5,
            response_format=ResponseFormat("choice", choices=("yes", "no")),
        )
        assert body(done) in ("yes", "no")
        client.close()

        with SyncRealtimeClient.connect(up.ws, encoding) as default:
            default.open(
                max_output_tokens=6, response_format=ResponseFormat("choice", choices=("red", "green"))
            )
            for seq, question in enumerate(["Name a colour.", "Name another colour."], start=1):
                assert body(default.turn(seq, text=ask(question))) in ("red", "green")
            default.close()
