"""The llama.cpp peer: start the user's `llama-server`, drive /completion on the same token ids.

The server runs with parallel slots and continuous batching (its defaults with --parallel),
the KV cache in the run's precision, and every request sends its prompt as token ids with
n_predict = output length and ignore_eos, so it produces exactly the tokens the others do.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from pagedllm.bench.gguf_convert import gguf_for_dtype
from pagedllm.bench.http_client import HTTPError, request_json, request_text, stream_events
from pagedllm.bench.results import LatencyRun, ThroughputRun
from pagedllm.bench.workloads import BenchRequest, Workload
from pagedllm.utils import cdiv

__all__ = ["LlamaBenchRunner", "LlamaCppRunner", "gguf_for_dtype"]

# llama.cpp's KV cache takes the element size of pagedllm's (EngineConfig's resolved
# kv_cache_dtype: bf16 for a GGUF kept quantized under fp32 activations): f32, or f16 (its
# default and best-tuned type) for a 16-bit cache, q8_0 (8-bit values, a scale per 32) for
# an int8 one. llama-bench parses no f32 cache type (its ggml_type_from_name): f16 there.
_KV_TYPES = {"float32": "f32", "bfloat16": "f16", "float16": "f16", "int8": "q8_0"}
_BENCH_KV_TYPES = {**_KV_TYPES, "float32": "f16"}

logger = logging.getLogger(__name__)

# A llama.cpp built natively on a CPU with AMX-INT8 repacks the weights for its AMX backend,
# which segfaults at the first prompt on some Xeons (llama.cpp issue #20824, open; ollama
# stopped shipping it). scripts/build_llamacpp.sh leaves that backend out there; a binary
# built elsewhere that crashes so is run again with repacking off, and its rows say so.
_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS)


def crashed(returncode: int | None) -> bool:
    """Whether a child process died of a memory or instruction fault (not an error exit)."""
    return returncode is not None and -returncode in _CRASH_SIGNALS


def default_llama_server() -> str | None:
    """$PAGEDLLM_LLAMA_SERVER, else the llama-server scripts/build_llamacpp.sh builds
    ($PAGEDLLM_LLAMACPP_DIR, default ~/.cache/pagedllm/llama.cpp, then build/bin/), where
    it exists; else None."""
    if path := os.environ.get("PAGEDLLM_LLAMA_SERVER"):
        return path
    root = os.environ.get("PAGEDLLM_LLAMACPP_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "llama.cpp"))
    path = os.path.join(root, "build", "bin", "llama-server")
    return path if os.access(path, os.X_OK) else None


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name: value} for unlabelled samples; llama-server's
    "llamacpp:" prefix dropped."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or line.startswith("#") or "{" in parts[0]:
            continue
        try:
            out[parts[0].removeprefix("llamacpp:")] = float(parts[1])
        except ValueError:
            continue
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_version(binary: str) -> str:
    """`llama-server --version` prints e.g. "version: 1 (0c1e570)" on stderr."""
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    line = next((l for l in (r.stdout + r.stderr).splitlines() if l.startswith("version")), "")
    return line.removeprefix("version:").strip() or "unknown"


def gguf_tensor_bytes(path: str) -> int:
    """The bytes of a GGUF's tensors, as stored (quantized or not): what llama.cpp reads for
    a token (a tied embedding is its output matrix)."""
    from pagedllm.loader.gguf_file import read_gguf
    return sum(t.n_bytes for t in read_gguf(path).tensors)


THROUGHPUT_TIMEOUT_S = 6 * 3600.0  # one throughput run's longest wait for an answer


class LlamaCppRunner:
    engine = "llama.cpp"

    def __init__(self, binary: str, gguf: str, dtype: str, threads: int, parallel: int,
                 max_seq_len: int, cache_prompt: bool = True, startup_timeout: float = 300.0,
                 user_gguf: bool = False, extra_args: tuple[str, ...] = (),
                 kv_dtype: str | None = None, repack: bool = True) -> None:
        """extra_args go to llama-server as given (e.g. its speculative-decoding flags);
        kv_dtype: the KV cache dtype of the pagedllm run compared with (default dtype);
        repack=False: --no-repack (llama.cpp's own layout; its repacked one can be slower,
        as on the AMX Xeon for Q4_K)."""
        kv_dtype = kv_dtype or dtype
        if dtype not in _KV_TYPES or kv_dtype not in _KV_TYPES:
            raise ValueError(f"llama.cpp runs float32, bfloat16 or float16, not {dtype!r} "
                             f"(KV cache {kv_dtype!r})")
        self.binary, self.gguf, self.dtype, self.threads = binary, gguf, dtype, threads
        self.kv_type = _KV_TYPES[kv_dtype]
        self.parallel, self.cache_prompt, self.user_gguf = parallel, cache_prompt, user_gguf
        self.slot_ctx = cdiv(max_seq_len + 16, 256) * 256  # a slot holds the longest request
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._version = server_version(binary)
        self.repack = repack and "--no-repack" not in extra_args
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
               "-c", str(parallel * self.slot_ctx), "--cont-batching",
               "-ctk", self.kv_type, "-ctv", self.kv_type, "--no-webui",
               *(a for a in extra_args if a != "--no-repack")]
        try:
            self._start(cmd if self.repack else [*cmd, "--no-repack"], startup_timeout)
        except RuntimeError:
            if not (self.repack and crashed(self.proc.returncode)):
                raise
            logger.warning("llama-server died of signal %d before it served (its log: %s); "
                           "running it again with --no-repack (llama.cpp issue #20824: its "
                           "AMX backend crashes on some Xeons)", -self.proc.returncode,
                           self.log_path)
            self.repack = False
            self._start([*cmd, "--no-repack"], startup_timeout)
        self._ids = 0

    def _start(self, cmd: list[str], timeout: float) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        self.cmd = cmd
        t = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        self.load_s = time.perf_counter() - t

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}; "
                                   f"its log ({self.log_path}) ends with:\n{self._log_tail()}")
            try:
                request_json("GET", f"{self.url}/health", timeout=5)
                return
            except (OSError, HTTPError):
                time.sleep(0.5)
        raise TimeoutError(f"llama-server did not become ready in {timeout:.0f} s; log: {self.log_path}")

    def _log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def versions(self) -> dict[str, str]:
        return {"llama.cpp": self._version}

    def settings(self) -> dict:
        return {"parallel_slots": self.parallel, "slot_ctx": self.slot_ctx,
                "cache_prompt": self.cache_prompt, "kv_cache_type": self.kv_type,
                "gguf": os.path.basename(self.gguf), "load_s": round(self.load_s, 2),
                "repack": self.repack,
                # a GGUF the user chose (--llama-gguf, e.g. the Q4_1 original) is named in the rows
                **({"label": os.path.basename(self.gguf), "weight_bytes": gguf_tensor_bytes(self.gguf)}
                   if self.user_gguf else {})}

    def _body(self, r: BenchRequest, stream: bool) -> dict:
        return {"prompt": r.prompt_token_ids, "n_predict": r.output_len, "ignore_eos": True,
                "temperature": 0.0, "cache_prompt": self.cache_prompt, "stream": stream}

    def _complete(self, r: BenchRequest, timeout: float = 600.0) -> int:
        out = request_json("POST", f"{self.url}/completion", self._body(r, stream=False),
                           timeout=timeout)
        return int(out["tokens_predicted"])

    def complete_tokens(self, prompt: list[int], n_predict: int, ignore_eos: bool) -> dict:
        """One greedy /completion on token ids, its generated token ids returned too
        ("tokens"; the server's "timings" hold its speculation counts)."""
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": ignore_eos,
                "temperature": 0.0, "cache_prompt": self.cache_prompt, "stream": False,
                "return_tokens": True}
        return request_json("POST", f"{self.url}/completion", body)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (it must run with --metrics), by name without
        the "llamacpp:" prefix."""
        return parse_prometheus(request_text(f"{self.url}/metrics"))

    def warmup(self, workload: Workload) -> None:
        for r in workload.requests:
            self._complete(r)

    def throughput(self, workload: Workload) -> ThroughputRun:
        """Every request sent at once; the server queues what its slots cannot take yet, so
        the last answer can take as long as the whole run (on a 2-core AVX2 CPU, 64 W1
        requests took llama-server over 600 s: the per-request limit is the run's)."""
        reqs = workload.requests
        t = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(len(reqs), 256)) as pool:
            lens = list(pool.map(lambda r: self._complete(r, timeout=THROUGHPUT_TIMEOUT_S), reqs))
        return ThroughputRun(time.perf_counter() - t, lens)

    def latency(self, workload: Workload, iters: int) -> LatencyRun:
        r = workload.requests[0]
        ttfts, rates, lens = [], [], []
        for _ in range(iters):
            start = time.perf_counter()
            times, n = [], 0
            # every iteration computes the whole prompt (as pagedllm's, its cache reset)
            body = {**self._body(r, stream=True), "cache_prompt": False}
            for now, event in stream_events(f"{self.url}/completion", body):
                times.append(now)
                if event.get("stop"):
                    n = int(event.get("tokens_predicted", 0))
            ttfts.append(times[0] - start)
            # Chunks can merge tokens (partial UTF-8 is held back): rate from the final count.
            rates.append((n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else float("nan"))
            lens.append(n)
        return LatencyRun(ttfts, rates, lens)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def default_llama_bench(server: str | None) -> str | None:
    """The llama-bench beside the llama-server in use (scripts/build_llamacpp.sh builds both)."""
    if server is None:
        return None
    path = os.path.join(os.path.dirname(server), "llama-bench")
    return path if os.access(path, os.X_OK) else None


class LlamaBenchRunner:
    """llama.cpp's own `llama-bench` on the latency request: its best single-stream figures,
    with no HTTP, tokenizer or sampling thread sharing the cores (llama-server's streamed
    decode runs at about half the rate on 2 cores). Time to first token: the prompt at its
    prompt-processing rate (`-p P -n 0`); decode: `-n N` generated on a context of P tokens
    (`-d P`), each iteration one of its samples. Latency only: it serves no requests."""

    engine = "llama-bench"

    def __init__(self, binary: str, gguf: str, dtype: str, threads: int,
                 user_gguf: bool = False, kv_dtype: str | None = None, repack: bool = True) -> None:
        kv_dtype = kv_dtype or dtype
        if dtype not in _KV_TYPES or kv_dtype not in _KV_TYPES:
            raise ValueError(f"llama.cpp runs float32, bfloat16 or float16, not {dtype!r} "
                             f"(KV cache {kv_dtype!r})")
        self.binary, self.gguf, self.dtype, self.threads = binary, gguf, dtype, threads
        self.kv_type = _BENCH_KV_TYPES[kv_dtype]
        self.user_gguf = user_gguf
        self.repack = repack
        self._version = server_version(binary)

    def _samples(self, prompt: int, gen: int, depth: int, iters: int) -> list[float]:
        """Tokens per second of each repetition of one llama-bench test."""
        cmd = [self.binary, "-m", self.gguf, "-t", str(self.threads), "-p", str(prompt),
               "-n", str(gen), "-d", str(depth), "-r", str(iters), "-o", "json",
               "-ctk", self.kv_type, "-ctv", self.kv_type, "--repack", str(int(self.repack))]
        run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if self.repack and crashed(run.returncode):
            logger.warning("llama-bench died of signal %d; running it again with --repack 0 "
                           "(llama.cpp issue #20824: its AMX backend crashes on some Xeons)",
                           -run.returncode)
            self.repack = False
            return self._samples(prompt, gen, depth, iters)
        if run.returncode != 0:
            raise RuntimeError(f"llama-bench exited with code {run.returncode}: "
                               f"{' '.join(cmd)}\n{run.stderr[-2000:]}")
        (test,) = json.loads(run.stdout)
        return [float(x) for x in test["samples_ts"]]

    def versions(self) -> dict[str, str]:
        return {"llama.cpp": self._version}

    def settings(self) -> dict:
        return {"kv_cache_type": self.kv_type, "gguf": os.path.basename(self.gguf),
                "repack": self.repack,
                **({"label": os.path.basename(self.gguf), "weight_bytes": gguf_tensor_bytes(self.gguf)}
                   if self.user_gguf else {})}

    def warmup(self, workload: Workload) -> None:
        """(llama-bench runs its own warm-up before each test.)"""

    def throughput(self, workload: Workload) -> ThroughputRun:
        raise NotImplementedError("llama-bench measures the latency request only")

    def latency(self, workload: Workload, iters: int) -> LatencyRun:
        r = workload.requests[0]
        prefill = self._samples(r.prompt_len, 0, 0, iters)
        decode = self._samples(0, r.output_len, r.prompt_len, iters)
        return LatencyRun([r.prompt_len / ts for ts in prefill], decode,
                          [r.output_len] * len(decode),
                          settings={"method": f"llama-bench -p {r.prompt_len} -n 0; "
                                              f"-n {r.output_len} -d {r.prompt_len}"})

    def close(self) -> None:
        pass
