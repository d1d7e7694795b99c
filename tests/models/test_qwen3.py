"""A small randomly initialised Qwen3 saved as an HF directory: logits and greedy tokens
match HF's Qwen3ForCausalLM in fp32; in bf16 at head_dim 128, prompts on pagedllm's
attention kernel stay close to torch's attention."""
from __future__ import annotations

import pytest
import torch

from family_harness import engine_logits  # tests/ (pytest prepends the rootdir)
from pagedllm import LLM, SamplingParams
from pagedllm.attention import cpu_paged
from pagedllm.kernels import ops
from pagedllm.loader import load_model_source

PROMPTS = ["Hello, my name is", "The quick brown fox", "def add(a, b):", "你好，世界"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = load_model_source(None).tokenizer      # any real tokenizer will do
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from 1 so the q/k norms matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir[0]), dtype="float32", kv_cache_memory_bytes=32 * 2**20,
               check_invariants=True)


def test_logits_match_hf(llm, qwen3_dir):
    _, hf = qwen3_dir
    tok = llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = engine_logits(llm, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_tokens_match_hf(llm, qwen3_dir):
    _, hf = qwen3_dir
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, min_tokens=24),
                        use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=24,
                              min_new_tokens=24, pad_token_id=2)
        assert out.token_ids == ref[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_q_k_norms_take_the_one_call_decode_stack_with_the_per_op_results(qwen3_dir, dtype,
                                                                          monkeypatch):
    from test_bf16 import assert_stack_equals_per_op  # tests/models (pytest's rootdir path)
    tok = load_model_source(None).tokenizer
    assert_stack_equals_per_op(str(qwen3_dir[0]), [tok.encode(p) for p in PROMPTS], monkeypatch,
                               dtype)


@pytest.fixture(scope="module")
def qwen3_head_dim_128_dir(tmp_path_factory):
    """Qwen3-0.6B's attention shape (head_dim 128, 2 query heads per KV head), tiny."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-qwen3-d128")
    tokenizer = load_model_source(None).tokenizer
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    transformers.Qwen3ForCausalLM(config).bfloat16().eval().save_pretrained(str(path))
    return path


def test_bf16_head_dim_128_prompts_on_the_kernel_stay_close_to_torch_attention(
        qwen3_head_dim_128_dir, monkeypatch):
    """bf16 prompts of head_dim 128 take pagedllm's prompt-attention kernel
    (cpu_paged.attention_kernel); greedy tokens against the torch attention backend pass
    vLLM's closeness rule: at the first token where they differ, each side's token is
    among the other's top-5."""
    if not cpu_paged.attention_kernel(torch.bfloat16, 128):
        pytest.skip("the prompt-attention kernel needs a build with AVX512-BF16")
    calls = {"prompt_attention": 0}
    prompt_attention = ops.prompt_attention

    def counting(*args, **kwargs):
        calls["prompt_attention"] += 1
        return prompt_attention(*args, **kwargs)

    monkeypatch.setattr(ops, "prompt_attention", counting)
    prompts = [[1000 + 37 * i + j for j in range(n)] for i, n in enumerate([5, 17, 40, 200])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = {}
    for backend in ("cpu_paged", "torch"):
        llm = LLM(str(qwen3_head_dim_128_dir), dtype="bfloat16", attention_backend=backend,
                  kv_cache_memory_bytes=16 * 2**20, max_model_len=512)
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    assert calls["prompt_attention"] > 0
    agreed = 0
    for ours, theirs in zip(outs["cpu_paged"], outs["torch"]):
        a, b = ours.outputs[0], theirs.outputs[0]
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        agreed += len(a.token_ids) if i is None else i
        if i is not None:
            assert a.token_ids[i] in {t for t, _ in b.logprobs[i].top}, i
            assert b.token_ids[i] in {t for t, _ in a.logprobs[i].top}, i
    # Not a lucky top-5 walk: most of the tokens agree exactly.
    assert agreed >= len(prompts) * 16 // 2, agreed
