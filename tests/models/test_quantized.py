"""quantization="gguf" (the default for a GGUF file): the bundled model's Q4_1 linears and
its Q8_0 tied embedding / LM head compute from the file's blocks. Greedy outputs stay close
to HF transformers' fp32 (vLLM's check: at the first token where the two continuations
differ, each side's token is in the other's top-5), the one-call decode stack gives the
per-op forward's tokens and logprobs, and what cannot be kept quantized is refused with a
clear error. (Other types and families: test_gguf_quantized.py.)"""
from __future__ import annotations

import pytest
import torch

from gguf import GGMLQuantizationType as Q

from decode_stack_counts import counting_stack_steps  # tests/ (pytest prepends the rootdir)
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import probes
from pagedllm.layers.linear import LinearBase

pytestmark = pytest.mark.skipif(not probes.gguf_linear_available(),
                                reason="the GGUF kernel needs a CPU with AVX2 or AVX-512")

NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=64 * 2**20, max_model_len=1024, enable_prefix_caching=False)


def test_every_linear_and_the_tied_head_compute_from_the_files_blocks(llm):
    assert llm.engine.config.quantization == "gguf"  # the default for a GGUF
    model = llm.engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * 30
    assert all([p.qtype for p in m.gguf_parts] == [Q.Q4_1] for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)       # never a bf16 copy
    embed = model.model.embed_tokens
    assert [p.qtype for p in embed.gguf_parts] == [Q.Q8_0] and embed.weight.numel() == 0
    assert model.lm_head.gguf_parts is embed.gguf_parts      # tied: one packing
    hidden = torch.randn(3, model.config.hidden_size).bfloat16()
    assert model.compute_logits(hidden).dtype == torch.float32


def test_an_explicit_dtype_dequantizes():
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=8 * 2**20, max_model_len=256)
    assert llm.engine.config.quantization == "none"
    model = llm.engine.model_runner.model
    assert model.lm_head.gguf_parts is None and model.lm_head.weight.dtype == torch.bfloat16


def _top5_hf(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].topk(5).indices.tolist()


def _top5_ours(llm: LLM, ids: list[int]) -> list[int]:
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    return [token for token, _ in out.logprobs[0].top]


@pytest.mark.slow
def test_greedy_close_to_hf_fp32(llm, hf_smollm, hf_greedy_tokens):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    agreed = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        theirs = hf_greedy_tokens([ids], NEW_TOKENS)[0]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), NEW_TOKENS)
        agreed += same
        if same < NEW_TOKENS:
            prefix = ids + list(ours[:same])
            assert ours[same] in _top5_hf(hf_smollm, prefix), (prompt, same)
            assert theirs[same] in _top5_ours(llm, prefix), (prompt, same)
    assert agreed >= len(PROMPTS) * NEW_TOKENS // 2, agreed   # not a lucky top-5 walk


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


@pytest.mark.slow
def test_fused_decode_stack_gives_the_per_op_forwards_tokens_and_logprobs(llm, monkeypatch):
    """Decode steps take the one-call stack with the GGUF weights too (every row count: the
    kernel's one-row and several-row tiles), with the per-op forward's results
    (enforce_eager=True) bit for bit; and batching does not change a sequence's tokens. bf16
    activations on AVX512-BF16 CPUs, fp32 ones (the default there) on AVX2-only CPUs."""
    from pagedllm.engine.cpu_decode_stack import CpuDecodeStack
    dtype = llm.engine.model_runner.dtype
    if not CpuDecodeStack.runs_here(dtype):
        pytest.skip(f"the decode stack does not run {dtype} on this CPU")
    assert llm.engine.model_runner.decode_stack is not None
    eager = LLM(kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
                enable_prefix_caching=False, enforce_eager=True)
    lengths = [15, 16, 17, 40, 3, 33, 64]
    prompts = [[1000 + 37 * i + j for j in range(length)] for i, length in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    counts = counting_stack_steps(monkeypatch)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:3]]
    for rows in (1, 3, 7):
        counts["stack"] = 0
        ours = llm.generate(prompts[:rows], params, use_tqdm=False)
        assert counts["stack"] == 11
        per_op = eager.generate(prompts[:rows], params, use_tqdm=False)
        assert counts["stack"] == 11
        for a, b in zip(ours, per_op):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
        for a, b in zip(ours, alone):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_short_prompt_after_a_cached_prefix_takes_the_decode_stack(monkeypatch):
    """With prefix caching, a prompt that adds at most 32 tokens to a cached prefix (a chat's
    next turn) is computed by the one-call stack as a decode step with several query tokens
    per row, with the per-op forward's tokens and logprobs, bit for bit. (fp32 rows, the
    default on AVX2 CPUs; bf16 prompt steps compute only the sampled row's last layer, op by
    op, on both sides.)"""
    from pagedllm.engine.cpu_decode_stack import CpuDecodeStack
    options = dict(kv_cache_memory_bytes=64 * 2**20, max_model_len=1024)
    llm = LLM(**options)
    rows = llm.engine.model_runner.dtype
    if not CpuDecodeStack.runs_here(rows):
        pytest.skip(f"the decode stack does not run {rows} rows on this CPU")
    prompts = [[1000 + 7 * j for j in range(48)]]
    prompts += [prompts[0] + [3000 + j for j in range(n)] for n in (1, 9, 20, 32)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    counts = counting_stack_steps(monkeypatch)
    ours = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    # after the first: cached blocks, then 1 new token (a decode step already), 9, 20 or 16
    expected = 3 if rows == torch.float32 else 0
    assert counts["several"] == expected
    eager = LLM(enforce_eager=True, **options)
    per_op = [eager.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert counts["several"] == expected
    for a, b in zip(ours, per_op):
        assert a.metrics.num_cached_tokens == b.metrics.num_cached_tokens
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    # (the 20- and 32-token ones also share their first new block)
    assert [o.metrics.num_cached_tokens for o in ours] == [0, 48, 48, 48, 64]


def test_what_cannot_stay_quantized_is_refused(tiny_gguf):
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        LLM(quantization="gguf", dtype="float16")
    with pytest.raises(ValueError, match="gguf or none"):
        LLM(quantization="awq")
    with pytest.raises(ValueError, match="one rank"):
        LLM(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="no weights of the types kept quantized"):  # F32
        LLM(model=str(tiny_gguf), quantization="gguf", kv_cache_memory_bytes=2**20)
