"""Soak test: many concurrent clients against a live OpenAI-compatible pagedllm server.

Each client loops until the deadline, sending a random request: chat or completion,
streamed or not, a prompt of random length up to the model's limit, sometimes stop
strings, sometimes n > 1 (when the server supports it), and sometimes hanging up
mid-stream or before the reply. Afterwards it checks what a long-running server must
keep: no 5xx, every KV block given back (``pagedllm_kv_blocks_used`` returns to 0), the
process's resident memory not growing beyond its caches.

    pagedllm bench soak --duration 600 --clients 64            # starts its own server
    python -m pagedllm.bench.soak --url http://127.0.0.1:8000 --server-pid 1234 --duration 60
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

WORDS = ("the of and to in is was for on that with as by at from his her it an be this are or "
         "had not but one all were they we when there can more if out so what time up about "
         "into than them only other new some could these two may first then do any like my "
         "now over such our man me even most made after also did many before must through "
         "years where much your way well down should because each just those people how "
         "too little state good very make world still own see men work long get here between "
         "both life being under never day same another know while last might us great old").split()
STOPS = ["\n\n", ".", " and", "!", "\n"]


@dataclass
class SoakConfig:
    url: str
    duration: float = 60.0
    clients: int = 64
    max_tokens: int = 32
    stream_share: float = 0.5
    chat_share: float = 0.5
    disconnect_share: float = 0.1
    stop_share: float = 0.2
    n_max: int = 2
    api_key: str | None = None
    server_pid: int | None = None
    request_timeout: float = 300.0
    drain_timeout: float = 60.0
    seed: int = 0
    progress: bool = True


@dataclass
class RequestRecord:
    kind: str                       # "chat" or "completion"
    stream: bool
    n: int
    prompt_words: int
    status: int | None = None       # HTTP status; None if the client hung up first
    error: str | None = None        # error body of a non-2xx, or an error event in the stream
    error_status: int | None = None  # the status code an in-stream error event carries
    disconnected: bool = False
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    num_chunks: int = 0
    seconds: float = 0.0


@dataclass
class SoakReport:
    duration: float
    clients: int
    requests: int
    completed: int
    disconnected: int
    by_status: dict[str, int]
    server_errors: int
    stream_errors: dict[str, int]
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    kv_blocks_used_after: int | None
    kv_blocks_total: int | None
    rss_start_mib: float | None
    rss_end_mib: float | None
    n_max: int
    first_errors: list[str]

    def table(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1000:.0f} ms"

        def mib(x: float | None) -> str:
            return "-" if x is None else f"{x:.0f} MiB"

        rows = [
            ("duration", f"{self.duration:.0f} s, {self.clients} concurrent clients"),
            ("requests sent / completed", f"{self.requests} / {self.completed}"),
            ("client disconnects (on purpose)", str(self.disconnected)),
            ("responses by status", ", ".join(f"{k}: {v}" for k, v in sorted(self.by_status.items()))),
            ("5xx (status or in-stream)", str(self.server_errors)),
            ("TTFT p50 / p99 (streamed)", f"{ms(self.ttft_p50)} / {ms(self.ttft_p99)}"),
            ("inter-token latency p50 / p99", f"{ms(self.itl_p50)} / {ms(self.itl_p99)}"),
            ("KV blocks used after the run", f"{self.kv_blocks_used_after} of {self.kv_blocks_total}"),
            ("server RSS start / end", f"{mib(self.rss_start_mib)} / {mib(self.rss_end_mib)}"),
            ("n > 1", "used" if self.n_max > 1 else "not supported by the server"),
        ]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ----------------------------------------------------------------------------- server probes

def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


async def kv_blocks(client: Any, url: str) -> tuple[int | None, int | None]:
    """(used, total) KV blocks from the server's Prometheus metrics."""
    response = await client.get(url + "/metrics")
    if response.status_code != 200:
        return None, None
    used = _metric(response.text, "pagedllm_kv_blocks_used")
    total = _metric(response.text, "pagedllm_kv_blocks_total")
    return (None if used is None else int(used)), (None if total is None else int(total))


async def wait_blocks_free(client: Any, url: str, timeout: float) -> tuple[int | None, int | None]:
    """Aborts are processed between steps: poll until no block is held (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        used, total = await kv_blocks(client, url)
        if used in (0, None) or time.monotonic() > deadline:
            return used, total
        await asyncio.sleep(0.5)


async def max_model_len(client: Any, url: str) -> int:
    response = await client.get(url + "/v1/models")
    response.raise_for_status()
    return int(response.json()["data"][0].get("max_model_len") or 2048)


async def tokens_per_word(client: Any, url: str) -> float:
    """How many prompt tokens one of our words costs on this server's tokenizer (>= 1)."""
    words = 8  # short enough for any model's limit
    body = {"prompt": " ".join(WORDS[:words]), "max_tokens": 1}
    response = await client.post(url + "/v1/completions", json=body)
    response.raise_for_status()
    return max(1.0, response.json()["usage"]["prompt_tokens"] / words)


async def supports_n(client: Any, url: str) -> bool:
    body = {"prompt": "Hello", "max_tokens": 1, "n": 2}
    return (await client.post(url + "/v1/completions", json=body)).status_code == 200


# ----------------------------------------------------------------------------- one request

def _body(rng: random.Random, cfg: SoakConfig, limit: int, n_max: int) -> tuple[str, dict, int]:
    """limit: the longest prompt in words (max_model_len / tokens per word)."""
    kind = "chat" if rng.random() < cfg.chat_share else "completion"
    max_tokens = rng.randint(1, cfg.max_tokens)
    # Up to the model's limit, and now and then just past it (a 400 then).
    words = rng.randint(1, limit)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.7, 1.0]),
                            "seed": rng.randint(0, 2**31)}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if rng.random() < cfg.stop_share:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if n_max > 1 and rng.random() < 0.2:
        body["n"] = rng.randint(2, n_max)
    return kind, body, words


async def one_request(client: Any, cfg: SoakConfig, rng: random.Random, limit: int,
                      n_max: int) -> RequestRecord:
    kind, body, words = _body(rng, cfg, limit, n_max)
    stream = rng.random() < cfg.stream_share
    body["stream"] = stream
    record = RequestRecord(kind, stream, body.get("n", 1), words)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    hang_up = rng.random() < cfg.disconnect_share
    start = time.perf_counter()
    try:
        if stream:
            await _streamed(client, cfg.url + path, body, record, start,
                            hang_up_after=rng.randint(1, 4) if hang_up else None)
        elif hang_up:  # give up before the reply: the server must abort the request
            record.disconnected = True
            try:
                await asyncio.wait_for(client.post(cfg.url + path, json=body), rng.uniform(0.05, 1.0))
            except asyncio.TimeoutError:
                pass
        else:
            response = await client.post(cfg.url + path, json=body)
            record.status = response.status_code
            if response.status_code >= 400:
                record.error = response.text[:300]
    except Exception as e:  # noqa: BLE001 - a transport error is a finding, not a crash
        record.error = f"{type(e).__name__}: {e}"
    record.seconds = time.perf_counter() - start
    return record


async def _streamed(client: Any, url: str, body: dict, record: RequestRecord, start: float,
                    hang_up_after: int | None) -> None:
    last = None
    async with client.stream("POST", url, json=body) as response:
        record.status = response.status_code
        if response.status_code >= 400:
            record.error = (await response.aread()).decode(errors="replace")[:300]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record.error = json.dumps(event)[:300]
                record.error_status = int(event["error"].get("code") or 500)
                return
            if not _has_content(event):
                continue
            now = time.perf_counter()
            if last is None:
                record.ttft = now - start
            else:
                record.itls.append(now - last)
            last = now
            record.num_chunks += 1
            if hang_up_after is not None and record.num_chunks >= hang_up_after:
                record.disconnected = True
                return  # leaving the block closes the connection mid-stream


def _has_content(event: dict) -> bool:
    for choice in event.get("choices", []):
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


# ----------------------------------------------------------------------------- the run

async def run_soak(cfg: SoakConfig) -> SoakReport:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # Idle connections are dropped after 2 s, before the server's keep-alive timeout
    # (uvicorn's 5 s, httpx's default expiry too): with equal timeouts a request sent on a
    # pooled connection just as the server closes it fails with a ReadError that is the
    # race's, not the server's.
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8,
                          keepalive_expiry=2.0)
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        ratio = await tokens_per_word(client, cfg.url)
        limit = max(1, int((await max_model_len(client, cfg.url) - cfg.max_tokens - 24) / ratio))
        n_max = cfg.n_max if cfg.n_max > 1 and await supports_n(client, cfg.url) else 1
        rss_start = rss_mib(cfg.server_pid)
        deadline = time.monotonic() + cfg.duration
        records: list[RequestRecord] = []

        bar = tqdm(total=round(cfg.duration), desc="soak", unit="s", disable=not cfg.progress)

        async def worker(index: int) -> None:
            rng = random.Random(cfg.seed * 100_003 + index)
            while time.monotonic() < deadline:
                records.append(await one_request(client, cfg, rng, limit, n_max))
                bar.set_postfix(requests=len(records), refresh=False)

        async def clock() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                bar.update(1)

        started = time.monotonic()
        await asyncio.gather(clock(), *(worker(i) for i in range(cfg.clients)))
        bar.close()
        elapsed = time.monotonic() - started
        used, total = await wait_blocks_free(client, cfg.url, cfg.drain_timeout)
        rss_end = rss_mib(cfg.server_pid)
    return summarize(records, cfg, elapsed, used, total, rss_start, rss_end, n_max)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[RequestRecord], cfg: SoakConfig, elapsed: float, used: int | None,
              total: int | None, rss_start: float | None, rss_end: float | None,
              n_max: int) -> SoakReport:
    by_status = Counter(str(r.status) if r.status is not None else "hung up" for r in records)
    stream_errors = Counter(str(r.error_status) for r in records if r.error_status is not None)
    server_errors = sum(1 for r in records
                        if (r.status or 0) >= 500 or (r.error_status or 0) >= 500
                        or (r.error or "").startswith(("RemoteProtocolError", "ReadError",
                                                       "ConnectError", "ReadTimeout")))
    completed = sum(1 for r in records if r.status == 200 and r.error is None and not r.disconnected)
    ttfts = [r.ttft for r in records if r.ttft is not None]
    itls = [x for r in records for x in r.itls]
    errors = [f"{r.status}: {r.error}" for r in records if r.error is not None
              and ((r.status or 0) >= 500 or (r.error_status or 0) >= 500 or r.status is None)]
    return SoakReport(
        duration=elapsed, clients=cfg.clients, requests=len(records), completed=completed,
        disconnected=sum(r.disconnected for r in records), by_status=dict(by_status),
        server_errors=server_errors, stream_errors=dict(stream_errors),
        ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50), itl_p99=percentile(itls, 99),
        kv_blocks_used_after=used, kv_blocks_total=total, rss_start_mib=rss_start,
        rss_end_mib=rss_end, n_max=n_max, first_errors=errors[:5])


# ----------------------------------------------------------------------------- a server of its own

class LaunchedServer:
    """`pagedllm serve` on a free port, for a soak that brings its own server."""

    def __init__(self, serve_args: list[str], log_path: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
               *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 600.0) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}; "
                                   f"see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------- command line

def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, to read its RSS")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request")
    p.add_argument("--disconnect-share", type=float, default=0.1,
                   help="share of requests that hang up early (default 0.1)")
    p.add_argument("--n-max", type=int, default=2, help="largest n, if the server supports n > 1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="write the report as JSON here")
    p.add_argument("--serve-args", default="--dtype float32 --max-model-len 512",
                   help="arguments of the server this command starts when --url is not given")


def run_from_args(args: argparse.Namespace) -> int:
    server = None
    url, pid = args.url, args.server_pid
    if url is None:
        log = os.path.abspath("soak-server.log")
        print(f"starting `pagedllm serve {args.serve_args}` (log: {log})", file=sys.stderr)
        server = LaunchedServer(args.serve_args.split(), log)
        server.wait_healthy()
        url, pid = server.url, server.proc.pid
    cfg = SoakConfig(url=url, duration=args.duration, clients=args.clients,
                     max_tokens=args.max_tokens, disconnect_share=args.disconnect_share,
                     n_max=args.n_max, api_key=args.api_key, server_pid=pid, seed=args.seed)
    print(f"soak: {cfg.clients} clients for {cfg.duration:.0f} s against {url}", file=sys.stderr)
    try:
        report = asyncio.run(run_soak(cfg))
    finally:
        if server is not None:
            server.stop()
    print(report.table())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    ok = report.server_errors == 0 and report.kv_blocks_used_after in (0, None)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm bench soak", description=__doc__.split("\n")[0])
    add_soak_args(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
