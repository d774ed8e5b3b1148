"""Incremental detokenization: a turn's text as its tokens arrive, each piece only what it adds.

The one decoder of streamed output: the worker's `output.delta`s (worker/server/service.py) and the
terminal chat (worker/console.py) both use it.
"""

from __future__ import annotations

from worker.tokenizer.tokenizer import Tokenizer

# What the tokenizer decodes an incomplete UTF-8 sequence to.
INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    """Decodes a turn's tokens as they come; a multi-byte character split over tokens is held back.

    Invariant: the concatenation of every piece `feed` returned is a prefix of the decoded tokens.
    Each feed decodes the turn so far: a turn is at most `max_output_tokens` long, not a session.
    """

    def __init__(self, tokenizer: Tokenizer | None, *, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.emitted = ""

    def feed(self, token: int) -> str | None:
        """The text `token` completes ("" while a character is incomplete); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)
        if text.endswith(INCOMPLETE) or not text.startswith(self.emitted):
            return ""
        added, self.emitted = text[len(self.emitted) :], text
        return added
