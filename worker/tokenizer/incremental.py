"""Exact incremental tokenization: text fed in pieces commits the tokens the whole text would give.

Why: a session streams its text in micro-turns, cut wherever the client's buffer happened to end
(mid-word, mid-number, mid-`<|im_start|>`). Encoding each piece on its own gives another token
sequence than encoding the concatenated text. Instead each session keeps a short uncommitted text
*tail* and commits only tokens that no continuation can change.

The rule (checked by property tests for every way of cutting a text, on byte-level BPE and
SentencePiece-style tokenizers; tests/worker/test_incremental_tokenizer.py):

- Added (special) tokens are matched in the raw text before pre-tokenization, so a text suffix
  that is a proper prefix of an added token's content (`<|im_`) may still become that token: it
  and everything after its start stay in the tail.
- BPE (and Unigram) never merge across pre-token ("word") boundaries, and a pre-tokenizer only
  ever changes its *last* word when text is appended (a partial word, number or whitespace run can
  grow or split). So every word but the last is final: its tokens are committed, the last word is
  the new tail. A completed added token at the very end is final too.
- The tail is re-encoded behind `context`, the text of the last committed word, so the tokenizer
  sees the tail mid-text, as the whole text would show it: SentencePiece's Metaspace with
  `prepend_scheme="first"` gives its `▁` prefix to the first word only. The context's own tokens
  are dropped. (ByteLevel's `add_prefix_space=True`, GPT-2/RoBERTa style, prefixes the context
  itself, which can re-split it when it starts with punctuation: such tokenizers are not exact in
  every cut. None of the models we ship uses it.)
- A flush (a chunk asking for output, a token chunk, an explicit `flush`) commits the whole tail
  and starts a new segment: between two flush points the committed tokens equal
  `tokenizer.encode(concatenated text)`.

Cost per piece: one encode of context + tail + piece, never of the session's history. The tail is
bounded by `max_tail_chars`: a single word longer than that (no whitespace, punctuation or digit in
thousands of characters) has its leading tokens committed early, the one case where the result may
differ from the whole-text encoding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The tail never holds more text than this (see the module docstring for the one inexact case).
MAX_TAIL_CHARS: Final = 1024
# The context only has to reach back over one word; a longer word is cut to its end.
MAX_CONTEXT_CHARS: Final = 256


@dataclass(frozen=True, slots=True)
class TextTail:
    """A session's uncommitted text state; immutable, so a refused chunk simply keeps the old one.

    Invariant: `context` is empty exactly at a segment start (nothing committed since the session
    began or since the last flush point); otherwise it is the text of the last committed word,
    which ends where `text` begins.
    """

    text: str = ""
    context: str = ""

    @property
    def empty(self) -> bool:
        return not self.text


EMPTY_TAIL: Final = TextTail()


class IncrementalTokenizer:
    """Stateless over `TextTail`s: `feed` returns the committed tokens and the next state."""

    def __init__(self, tokenizer: Tokenizer, *, max_tail_chars: int = MAX_TAIL_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_tail_chars = max_tail_chars
        added = tokenizer.backend.get_added_tokens_decoder()
        self._added_ids = frozenset(int(i) for i in added)
        contents = [token.content for token in added.values() if token.content]
        # Proper prefixes only: a complete added token is final unless it begins a longer one.
        self._special_prefixes = frozenset(c[:k] for c in contents for k in range(1, len(c)))
        self._longest_prefix = max((len(p) for p in self._special_prefixes), default=0)

    def feed(self, state: TextTail, text: str, *, flush: bool) -> tuple[list[int], TextTail]:
        """Append `text`; returns (tokens committed now, new state). Pure: `state` is untouched."""
        pending = state.text + text
        if not pending:
            return [], EMPTY_TAIL if flush else state
        context = state.context
        # A suffix that may still become an added token is not encoded at all: whether it does
        # decides where the text before it ends, and so how that text splits into words.
        held = 0 if flush else self._special_prefix_len(pending)
        visible = context + pending[: len(pending) - held]
        ids, offsets, words = self._encode(visible)
        first = _first_token_at(offsets, len(context))
        if first is None:
            # The context did not end on a token boundary in this encoding (not seen in the tests):
            # encode the pending text alone rather than commit tokens of already committed text.
            logger.debug("context %r did not end on a token boundary; encoding the tail alone", context)
            context, visible = "", pending[: len(pending) - held]
            ids, offsets, words = self._encode(visible)
            first = 0
        if flush:
            return ids[first:], EMPTY_TAIL
        cut = self._committable(ids, offsets, words, first)
        if len(context) + len(pending) - (offsets[cut][0] if cut < len(ids) else len(visible)) > (
            self.max_tail_chars
        ):
            cut = _cap_tail(offsets, cut, len(context) + len(pending) - self.max_tail_chars // 2)
        if cut == first:
            return [], TextTail(pending, context)
        full = context + pending
        tail_start = offsets[cut][0] if cut < len(ids) else len(visible)
        word_start = _word_start(offsets, words, cut - 1, first)
        new_context = full[max(word_start, tail_start - MAX_CONTEXT_CHARS) : tail_start]
        return ids[first:cut], TextTail(full[tail_start:], new_context)

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]], list[int | None]]:
        encoding = self.tokenizer.backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets), list(encoding.word_ids)

    def _committable(
        self, ids: list[int], offsets: list[tuple[int, int]], words: list[int | None], first: int
    ) -> int:
        """Index of the first token that must stay in the tail: the start of the last word.

        A completed added token at the very end is final (it is no proper prefix of another one,
        or it would have been held back), so then everything is committable.
        """
        n = len(ids)
        if n == first or ids[n - 1] in self._added_ids:
            return n
        index = n - 1
        while index > first and words[index] is not None and words[index - 1] == words[index]:
            index -= 1
        return index

    def _special_prefix_len(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of an added token."""
        for k in range(min(self._longest_prefix, len(pending)), 0, -1):
            if pending[-k:] in self._special_prefixes:
                return k
        return 0


def _cap_tail(offsets: list[tuple[int, int]], cut: int, before: int) -> int:
    """Move `cut` forward to the last clean token boundary at or before char `before`."""
    best = cut
    for index in range(cut + 1, len(offsets)):
        if offsets[index][0] > before:
            break
        if offsets[index - 1][1] <= offsets[index][0]:
            best = index
    return best


def _first_token_at(offsets: list[tuple[int, int]], position: int) -> int | None:
    """Index of the first token starting at or after `position`, if every earlier one ends by then."""
    for index, (start, end) in enumerate(offsets):
        if start >= position:
            return index
        if end > position:
            return None
    return len(offsets)


def _word_start(offsets: list[tuple[int, int]], words: list[int | None], index: int, first: int) -> int:
    """The start of the word holding token `index` (not looking before token `first`)."""
    word = words[index]
    while index > first and word is not None and words[index - 1] == word:
        index -= 1
    return offsets[index][0]
