"""The engine through each attention backend this machine can run: the CPU path (the C++
cpu_paged kernel by default, torch_native by choice) imports no GPU package, and the
Triton backend (in the Triton interpreter) gives the same greedy tokens as both on a
random Qwen3."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiny_models import make_qwen3_dir  # tests/ (pytest prepends the rootdir)

# a subprocess per backend, the Triton one interpreted (about 12 s)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    prompts = ["Hello, my name is", "def add(a, b):", "The quick brown fox jumps"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    result = {}
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=8 * 2**20)
    assert llm.engine.model_runner.attention_backend == "cpu_paged"
    result["cpu_paged"] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=8 * 2**20,
              attention_backend="torch")
    result["torch"] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    result["gpu_modules_on_cpu_path"] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("triton", "flash_attn")
        or m in ("pagedllm.attention.triton_backend", "pagedllm.attention.flash_backend"))
    # A prefix-cache hit on the second round exercises the prefill-over-cached-prefix kernel.
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=8 * 2**20,
              attention_backend="triton")
    assert llm.engine.model_runner.attention_backend == "triton"
    result["triton"] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    long = ["Once upon a time, in a small village by the sea, there lived an old fisherman "
            "who went out every morning before the sun rose."]
    first = llm.generate(long, sp, use_tqdm=False)[0]
    again = llm.generate(long, sp, use_tqdm=False)[0]
    result["prefix_hit"] = [first.token_ids, again.token_ids, again.metrics.num_cached_tokens]
    print("RESULT", json.dumps(result))
"""


def test_cpu_path_imports_no_gpu_code_and_every_backend_gives_the_same_tokens(tmp_path):
    model = make_qwen3_dir(tmp_path / "qwen3", num_kv_heads=2)
    script = tmp_path / "backends.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1",
           "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(script), str(model)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    result = json.loads(line.removeprefix("RESULT"))
    assert result["gpu_modules_on_cpu_path"] == []
    assert result["cpu_paged"] == result["torch"]
    assert result["triton"] == result["torch"]
    first, again, cached = result["prefix_hit"]
    assert cached >= 16 and again == first
