"""llama-server with its weights repacked or not (--llama-no-repack). One whose repacked
weights crash it (its AMX backend on some Xeons, llama.cpp issue #20824) is started again
with repacking off, and the rows say so; any other failure is still an error. Driven
against a stand-in server that crashes as the real one does (llama-bench's side:
test_llama_bench.py)."""
from __future__ import annotations

import stat

import pytest

from pagedllm.bench.llamacpp_runner import LlamaCppRunner, crashed

SERVER = """#!/usr/bin/env python3
import http.server, os, signal, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 1 (fake)"); sys.exit(0)
if "--no-repack" not in args:
    print("load_tensors: AMX model buffer size = 1 MiB", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
if {fail!r}:
    print("error: bad model", flush=True); sys.exit(1)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")

http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
"""


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_only_faults_count_as_crashes():
    assert crashed(-11) and crashed(-4) and crashed(-7)
    assert not crashed(None) and not crashed(0) and not crashed(1) and not crashed(-15)


def test_llama_server_that_segfaults_repacked_starts_again_without_repacking(tmp_path):
    binary = executable(tmp_path / "llama-server", SERVER.format(fail=False))
    runner = LlamaCppRunner(binary, "m.gguf", "float32", threads=1, parallel=1, max_seq_len=64,
                            startup_timeout=60)
    try:
        assert runner.cmd[-1] == "--no-repack" and runner.proc.poll() is None
        assert runner.settings()["repack"] is False
    finally:
        runner.close()


def test_llama_server_that_fails_without_repacking_too_is_an_error(tmp_path):
    binary = executable(tmp_path / "llama-server", SERVER.format(fail=True))
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*bad model"):
        LlamaCppRunner(binary, "m.gguf", "float32", threads=1, parallel=1, max_seq_len=64,
                       startup_timeout=60)


def test_repack_off_is_asked_for_from_the_start(tmp_path):
    # --llama-no-repack: llama.cpp's faster layout on some CPUs, no crash needed
    server = LlamaCppRunner(executable(tmp_path / "llama-server", SERVER.format(fail=False)), "m.gguf",
                            "float32", threads=1, parallel=1, max_seq_len=64, startup_timeout=60,
                            repack=False, extra_args=("--metrics",))
    try:
        assert server.cmd.count("--no-repack") == 1 and "--metrics" in server.cmd
        assert server.settings()["repack"] is False
    finally:
        server.close()
