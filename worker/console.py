"""An interactive chat with one streaming session in the terminal: the engine without any server.

Each line typed is wrapped in the model's chat template and streamed to the session in 4-token
micro-turns that ask for no output; the last chunk asks for the reply, printed as it is sampled.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from worker.engine import Engine, TokenDelta
from worker.tokenizer.detokenize import IncrementalDecoder
from worker.tokenizer.tokenizer import Tokenizer

CHUNK_TOKENS = 4


def reply_printer(tokenizer: Tokenizer, stdout: TextIO) -> Callable[[TokenDelta], None]:
    """A token listener that writes the reply as it is sampled, special tokens left out."""
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)

    def show(delta: TokenDelta) -> None:
        if added := decoder.feed(delta.token):
            stdout.write(added)
            stdout.flush()

    return show


def chat(
    engine: Engine, *, max_reply_tokens: int, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout
) -> None:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise SystemExit("this model has no tokenizer: the console needs text")
    sid = engine.open_session(idle_timeout_s=None)
    stdout.write(
        f"microturn console: {engine.model_config.name}, session {sid}. Type a message; Ctrl-D quits.\n"
    )
    first = True
    for line in stdin:
        message = line.strip()
        if not message:
            continue
        prompt = tokenizer.chat_prompt(message, system="You are a helpful AI assistant." if first else None)
        first = False
        tokens = tokenizer.encode(prompt)
        started = time.perf_counter()
        chunks = [tokens[i : i + CHUNK_TOKENS] for i in range(0, len(tokens), CHUNK_TOKENS)]
        for chunk in chunks[:-1]:
            engine.submit(sid, tokens=chunk, max_output_tokens=0)
        printer = reply_printer(tokenizer, stdout)
        result = engine.run_turn(sid, tokens=chunks[-1], max_output_tokens=max_reply_tokens, on_token=printer)
        elapsed = (time.perf_counter() - started) * 1000
        stdout.write(
            f"\n  [{len(chunks)} chunks, {len(result.tokens)} tokens, "
            f"{elapsed:.0f} ms, finish={result.finish}]\n"
        )
        if result.finish == "stop":
            engine.submit(sid, tokens=tokenizer.encode("\n"), max_output_tokens=0)
    engine.close_session(sid)
