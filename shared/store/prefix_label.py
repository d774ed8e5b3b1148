"""A named prefix: how placement finds the worker that holds the KV of an open's instructions (#33).

A session whose open names its prefix as text (`keep_prefix_text`: a native client's system prompt,
the OpenAI dialect's instructions) can open where that prefix's pages are already cached, and then
computes only its own tokens (worker/engine/memory/prefix_cache.py). The gateway has no tokenizer,
so the name is a hash of the text, computed alike by the gateway when it places the session
(shared/store/placement.py) and by the worker when it publishes, in its registry entry, the names
of the prefixes whose pages it holds (most recently opened first, at most MAX_PUBLISHED_PREFIXES).
"""

from __future__ import annotations

import hashlib
from typing import Final

# A worker's registry entry names at most this many prefixes (a bound on its hash's size).
MAX_PUBLISHED_PREFIXES: Final = 32
# Published names are joined by this separator in one hash field (the names are hex).
PREFIX_SEPARATOR: Final = " "


def prefix_label(text: str) -> str:
    """The name of the prefix `text` (16 hex digits)."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
