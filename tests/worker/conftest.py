from __future__ import annotations

from collections.abc import Iterator

import pytest

from worker.engine import Engine


@pytest.fixture
def tiny() -> Iterator[Engine]:
    with Engine.load(
        "tiny",
        kv_tokens=4096,
        page_size=16,
        max_chunk_tokens=256,
        max_pending_tokens=64,
        max_pending_outputs=2,
    ) as engine:
        yield engine
