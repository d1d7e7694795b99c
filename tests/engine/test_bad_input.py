"""Bad input gets a clear error naming the problem, and the same LLM keeps serving."""
from __future__ import annotations

import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loader import ModelLoadError


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * 2**20,
               check_invariants=True)


def good_request_still_works(llm: LLM) -> None:
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert out.text.startswith(" Paris")
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompts must be"),
    ([[]], SamplingParams(), "prompt is empty"),
    ("word " * 400, SamplingParams(), "max_model_len is 256"),
    ([[1, 2, 10**9]], SamplingParams(), "outside the vocabulary"),
])
def test_bad_prompt_is_rejected_and_engine_still_serves(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    good_request_still_works(llm)


def test_one_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["Hello", "word " * 400], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    good_request_still_works(llm)


def test_request_larger_than_the_whole_cache_is_rejected():
    llm = LLM(dtype="float32", max_model_len=1024, block_size=16,
              kv_cache_memory_bytes=8 * 16 * 2 * 30 * 3 * 64 * 4)   # 8 blocks = 128 tokens
    with pytest.raises(ValueError, match="whole KV cache holds 8 blocks"):
        llm.generate("hello", SamplingParams(max_tokens=500), use_tqdm=False)
    good_request_still_works(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1), "temperature"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_options_name_the_option():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="int3")


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist.gguf"))


def test_truncated_gguf(tmp_path, gguf_path):
    broken = tmp_path / "broken.gguf"
    with open(gguf_path, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(str(broken))
