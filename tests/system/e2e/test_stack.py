"""`microturn up` end to end: the command a user runs, a real chat through it, and a clean Ctrl-C.

Why through the real command: `up` is three processes and a supervisor; the failure modes that
matter (a child left running after Ctrl-C, Valkey stopped before the worker could deregister, a
crash that leaves the stack half up) only show with real processes and real signals.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from shared.client.clients import SyncRealtimeClient
from tests.shared.redis_servers import running_server
from tests.system.e2e.up import STOP_TIMEOUT_S, Up, gone, kill_leftovers, launch, running_up

pytestmark = pytest.mark.slow

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# A question SmolLM2 answers "The capital of France is Paris." by 1.4 logits or more at every token up to
# "Paris", behind its default system prompt, in every form served here (int4 with a float16 or a
# float32 KV pool, float); "What is the capital of France?" is there a near-tie (0.05-0.08 logits
# against "L'Étoile ..."), which any numeric change may tip (docs/benchmarks.md, "The KV pool in
# float16 for the quantised forms").
QUESTION = "Name the capital of France."


def pieces(text: str, words: int = 2) -> list[str]:
    """`text` in pieces of a few words, each piece starting with its leading space (as typed)."""
    split = text.split(" ")
    tokens = [split[0]] + [" " + word for word in split[1:]]
    return ["".join(tokens[i : i + words]) for i in range(0, len(tokens), words)]


def test_a_chat_through_up(smollm2_up: Up) -> None:
    """The stack `up` starts by default (the package's shared one, as a user starts it): Valkey, a
    SmolLM2 worker and a gateway, and a real chat through it."""
    up = smollm2_up
    names = sorted(" ".join(p.cmdline()) for p in up.children)
    assert len(up.children) == 3, names
    for needle in ("valkey-server", "microturn worker", "microturn gateway"):
        up.child(needle)

    with SyncRealtimeClient.connect(up.ws) as client:
        opened = client.open(stream=True, max_output_tokens=0)
        assert opened.model == "smollm2-135m"
        # SmolLM2's ChatML template, typed a couple of words at a time.
        chunks = ["<|im_start|>system\n", *pieces(SYSTEM_PROMPT), "<|im_end|>\n"]
        chunks += ["<|im_start|>user\n", *pieces(QUESTION)]
        seq = 0
        for text in chunks:
            seq += 1
            done = client.turn(seq, text=text, max_output_tokens=0)
            assert (done.seq, done.tokens, done.finish) == (seq, (), "length")
        seq += 1
        reply = client.turn(seq, text="<|im_end|>\n<|im_start|>assistant\n", max_output_tokens=64)
        streamed = "".join(delta.text or "" for delta in client.last_deltas)
        assert reply.text is not None
        assert "Paris" in reply.text, reply.text
        assert streamed == reply.text
        assert reply.finish == "stop"
        seq += 1
        assert client.turn(seq, text="\n", max_output_tokens=0).tokens == ()
        client.close()


def test_ctrl_c_after_a_chat_stops_everything_valkey_last(tmp_path: Path) -> None:
    """Ctrl-C is the supervisor's, whatever the model: `tiny` here, so the stack is up in seconds
    (the SmolLM2 chat is test_a_chat_through_up's, on the package's shared `up`)."""
    with running_up(tmp_path, "--model", "tiny", "--kv-tokens", "4096") as up:
        names = sorted(" ".join(p.cmdline()) for p in up.children)
        assert len(up.children) == 3, names
        for needle in ("valkey-server", "microturn worker", "microturn gateway"):
            up.child(needle)
        with SyncRealtimeClient.connect(up.ws) as client:
            client.open(stop_token_ids=[], max_output_tokens=2)
            assert len(client.turn(1, tokens=[5, 6, 7, 8]).tokens) == 2
            client.close()

        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(STOP_TIMEOUT_S) == 0, up.output()[-4000:]
        assert gone(up.children) == [], up.output()[-4000:]
        output = up.output()
        # The worker drained and left the registry while Valkey was still up: Valkey stopped last.
        assert output.index("deregistered worker") < output.index("stopping valkey"), output[-4000:]


def test_up_stops_everything_when_a_child_dies(tmp_path: Path) -> None:
    with running_up(tmp_path, "--model", "tiny", "--kv-tokens", "4096") as up:
        worker = up.child("microturn worker")
        worker.kill()
        assert up.proc.wait(STOP_TIMEOUT_S) != 0
        assert gone(up.children) == [], up.output()[-4000:]
        assert "worker exited" in up.output()


def test_ctrl_c_while_the_worker_loads(tmp_path: Path) -> None:
    up = launch(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not any("microturn worker" in " ".join(p.cmdline()) for p in up.record_children()):
            assert up.proc.poll() is None, up.output()[-4000:]
            assert time.monotonic() < deadline, up.output()[-4000:]
            time.sleep(0.05)
        # Usually mid-load (SmolLM2 takes seconds); if it was quicker, this stops a running stack.
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(STOP_TIMEOUT_S) == 0, up.output()[-4000:]
        assert gone(up.children) == [], up.output()[-4000:]
    finally:
        kill_leftovers(up)


def test_up_with_an_external_redis_starts_no_valkey(tmp_path: Path) -> None:
    tiny = ("--model", "tiny", "--kv-tokens", "4096")
    with (
        running_server("redis", tmp_path) as redis_url,
        running_up(tmp_path, "--redis-url", redis_url, *tiny) as up,
    ):
        commands = [" ".join(p.cmdline()) for p in up.children]
        assert len(commands) == 2 and not any("valkey" in c for c in commands), commands
        with SyncRealtimeClient.connect(up.ws) as client:
            client.open(stop_token_ids=[], max_output_tokens=2)
            done = client.turn(1, tokens=[5, 6, 7, 8])
            assert len(done.tokens) == 2
            client.close()
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(STOP_TIMEOUT_S) == 0, up.output()[-4000:]
        assert gone(up.children) == []
