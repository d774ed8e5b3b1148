"""Incremental detokenization for streamed deltas: each delta carries only the text it adds."""

from __future__ import annotations

from worker.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    """Decodes a turn's tokens as they come; a multi-byte character split over tokens is held back."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def feed(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith(INCOMPLETE) or not text.startswith(self.emitted):
            return ""
        added, self.emitted = text[len(self.emitted) :], text
        return added
