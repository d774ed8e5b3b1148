"""Fixtures of the end-to-end tests: one `microturn up` with its default model (SmolLM2) for the
tests that only use a running stack; the tests of `up`'s own start and stop run their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.system.e2e.up import Up, running_up


@pytest.fixture(scope="package")
def smollm2_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`microturn up` as a user starts it, shared: loading SmolLM2 is most of what a start costs,
    and a test that only chats through the stack changes nothing the next one could see (each opens
    its own session)."""
    with running_up(tmp_path_factory.mktemp("smollm2-up")) as up:
        yield up
