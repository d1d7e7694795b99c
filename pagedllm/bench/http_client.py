"""A minimal blocking HTTP client for the bench: JSON requests and server-sent events.

The standard library is enough, and blocking calls in threads keep the timing of each
streamed chunk honest (a chunk's time is when its line was read, not when a loop got to it).
"""
from __future__ import annotations

import http.client
import json
import time
from typing import Any, Iterator
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    pass


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"expected an http(s) URL, got {url!r}")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout), path


def request_json(method: str, url: str, body: Any = None, timeout: float = 600.0,
                 headers: dict[str, str] | None = None) -> Any:
    return json.loads(request_text(url, method, body, timeout, headers))


def request_text(url: str, method: str = "GET", body: Any = None, timeout: float = 600.0,
                 headers: dict[str, str] | None = None) -> str:
    """The body of a 200 response as text (HTTPError otherwise)."""
    conn, path = _connection(url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace")
        if resp.status != 200:
            raise HTTPError(f"{method} {url} -> HTTP {resp.status}: {text[:500]}")
        return text
    finally:
        conn.close()


def stream_events(url: str, body: Any, timeout: float = 600.0,
                  headers: dict[str, str] | None = None) -> Iterator[tuple[float, Any]]:
    """POST ``body`` and yield (arrival time, parsed JSON) per ``data:`` event, until [DONE]."""
    conn, path = _connection(url, timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                              **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise HTTPError(f"POST {url} -> HTTP {resp.status}: "
                            f"{resp.read().decode('utf-8', 'replace')[:500]}")
        while True:
            line = resp.readline()
            if not line:
                return
            now = time.perf_counter()
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue
            payload = text[5:].strip()
            if payload == "[DONE]":
                return
            yield now, json.loads(payload)
    finally:
        conn.close()
