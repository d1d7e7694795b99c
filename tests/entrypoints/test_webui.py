"""The page at `/` in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright):
the KV block grid, a streamed chat reply, and the grid showing used blocks while it runs."""
from __future__ import annotations

import shutil
import tempfile
import time

import httpx
import pytest

# headless Chromium around a streamed chat (about 20 s)
pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
QUESTION = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        # A persistent context is the only way to give Chromium our own --user-data-dir.
        context = p.chromium.launch_persistent_context(
            tempfile.mkdtemp(dir=tmp_path_factory.mktemp("chromium")),
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = context.new_page()
        page.goto(server.url + "/")
        yield page
        context.close()


def test_page_chats_with_a_streamed_reply_while_the_grid_shows_used_blocks(server, page, tmp_path):
    num_blocks = httpx.get(server.url + "/kv_cache", timeout=30).json()["stats"]["num_blocks"]
    page.wait_for_function(f"document.querySelectorAll('#kv-grid .block').length === {num_blocks}")
    assert page.locator('#kv-grid .block[data-state="used"]').count() == 0

    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    page.fill("#prompt", QUESTION)
    page.click("#send")

    reply = page.locator(".msg.assistant").last
    used_seen, partial_lengths = 0, set()
    deadline = time.time() + 300
    while reply.get_attribute("data-done") != "true":
        assert time.time() < deadline, "the reply never finished"
        used_seen = max(used_seen, page.locator('#kv-grid .block[data-state="used"]').count())
        partial_lengths.add(len(reply.inner_text()))
        page.wait_for_timeout(30)
    text = reply.inner_text()
    page.screenshot(path=str(tmp_path / "webui.png"), full_page=True)

    assert used_seen > 0, "the grid never showed a used block during generation"
    assert len(partial_lengths - {0, len(text)}) > 0, "the reply did not arrive in pieces"
    # The streamed reply is the server's greedy answer to the same conversation.
    want = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
        "max_tokens": 48}).json()["choices"][0]["message"]["content"]
    assert text == want.strip() or text == want
    # Afterwards every block is free again (some keep a cached prefix).
    page.wait_for_function("document.querySelector('#kv-stats').dataset.used === '0'")
    assert page.locator('#kv-grid .block[data-state="used"]').count() == 0
    assert page.locator('#kv-grid .block[data-state="cached"]').count() > 0
    assert (tmp_path / "webui.png").stat().st_size > 0
