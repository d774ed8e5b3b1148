"""The demo page in a real headless Chromium against a real `microturn up`.

Why a browser and not only the Python client: the page is the product's first impression and pure
JavaScript; only a browser proves that typing streams micro-turns, that the ChatML template holds
across turns, that replies stream in, and that latencies show. Chromium is Debian's package driven
by Playwright's Python API; Playwright never downloads a browser here (`executable_path`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.system.e2e.up import Up

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = "/usr/bin/chromium"
# From the machine notes: no sandbox (root in a container), no GPU, no background traffic.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPLY_TIMEOUT_MS = 180_000
TYPE_DELAY_MS = 45  # per key: typing takes a few seconds, so several micro-turns go out while typing


# Marks, not skips in a fixture: a skip mark acts before any fixture is set up, so without Chromium
# no stack is started just to be thrown away.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.access(CHROMIUM, os.X_OK), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="the playwright package is missing: pip install playwright (no browser download needed)",
    ),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def ask(page: Page, text: str, turn: int) -> tuple[str, str]:
    """Type `text` key by key, press Enter, wait for the reply; return its text and its meta line."""
    page.locator("#input").press_sequentially(text, delay=TYPE_DELAY_MS)
    page.locator("#input").press("Enter")
    reply = page.locator(".msg.assistant").nth(turn)
    page.wait_for_function(
        "n => { const m = document.querySelectorAll('.msg.assistant')[n];"
        " return m && (m.dataset.state === 'done' || m.dataset.state === 'error'); }",
        arg=turn,
        timeout=REPLY_TIMEOUT_MS,
    )
    assert reply.get_attribute("data-state") == "done", page.locator("#error").inner_text()
    return reply.locator(".text").inner_text(), reply.locator(".meta").inner_text()


def test_chat_in_the_browser(smollm2_up: Up, browser: Browser, tmp_path: Path) -> None:
    stack = smollm2_up
    page = browser.new_page(viewport={"width": 1100, "height": 820})
    problems: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda request: requests.append(request.url))
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    try:
        page.goto(stack.http + "/")
        page.wait_for_selector("#status[data-state='open']", timeout=30_000)
        assert page.locator("#model").inner_text() == "smollm2-135m"

        # Not "What is the capital of France?": a near-tie behind the page's system prompt (test_stack.py).
        text, meta = ask(page, "Name the capital of France.", 0)
        assert text.strip(), "empty reply"
        assert "Paris" in text
        assert "reply" in meta and " ms" in meta  # the turn's latency, e.g. "reply 512 ms · first token ..."
        assert page.locator("#stat-reply").inner_text().endswith("ms")
        # The system prompt and the typed words went out as micro-turns, each with its latency.
        assert int(page.locator("#stat-count").inner_text()) >= 2
        timed = page.locator("#chips .chip .ms").all_inner_texts()
        assert sum(label.endswith(" ms") for label in timed) >= 2, timed

        # A second turn: the template carries on after the first reply (its "\n" glue chunk).
        text2, _meta2 = ask(page, "And what is the capital of Germany?", 1)
        assert text2.strip(), "empty second reply"

        page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
        assert not page.locator("#error.show").count(), page.locator("#error").inner_text()

        # Words the model has read are locked: once "Tell" has streamed, deleting into it is undone.
        page.locator("#input").press_sequentially("Tell me", delay=TYPE_DELAY_MS)
        page.wait_for_function("() => document.querySelector('#seen .streamed')?.textContent === 'Tell'")
        for _ in range(6):
            page.locator("#input").press("Backspace")
        assert page.locator("#input").input_value() == "Tell"
        assert problems == []
        # Self-contained: the page, the favicon probe and the WebSocket are all it asks for.
        assert all(url.startswith((stack.http, stack.ws)) for url in requests), requests
        assert sockets == [stack.ws]
    finally:
        page.close()
