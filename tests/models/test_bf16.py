"""bfloat16 (the default dtype on CPUs with native bf16): sane answers, and greedy outputs
close to HF transformers' bf16 by vLLM's check: at the first token where the two greedy
continuations differ, each side's token is among the other's top-5."""
from __future__ import annotations

import pytest
import torch

from decode_stack_counts import counting_stack_steps  # tests/ (pytest prepends the rootdir)
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.cpu_decode_stack import CpuDecodeStack
from pagedllm.kernels import build, probes

NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024)


@pytest.fixture(scope="module")
def hf_bf16(gguf_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.bfloat16)
    return model.eval()


def test_default_dtype_follows_the_cpu():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert EngineConfig().torch_dtype == (torch.bfloat16 if native else torch.float32)


def test_auto_dtype_is_resolved_once_for_every_tensor_parallel_rank():
    """resolve() makes 'auto' concrete before rank 0 hands the config to spawned ranks."""
    config = EngineConfig(tensor_parallel_size=2)
    config.resolve(512)
    assert config.dtype != "auto"
    assert config.torch_dtype == EngineConfig().torch_dtype


def test_bf16_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


def _top5(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return logits.topk(5).indices.tolist()


def _our_top5(llm: LLM, ids: list[int]) -> list[int]:
    """Our model's top-5 next tokens after ids (logits of one prefill through the engine)."""
    runner = llm.engine.model_runner
    logits = runner.model.compute_logits(_our_last_hidden(llm, ids))
    return logits[0].float().topk(5).indices.tolist()


def _our_last_hidden(llm: LLM, ids: list[int]) -> torch.Tensor:
    return _prefill_hidden(llm, [ids], None)[-1:]


@pytest.mark.slow
def test_bf16_greedy_close_to_hf_bf16(llm, hf_bf16):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    agreed = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        with torch.inference_mode():
            theirs = hf_bf16.generate(torch.tensor([ids]), do_sample=False,
                                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      pad_token_id=2)[0, len(ids):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), NEW_TOKENS)
        agreed += same
        if same < NEW_TOKENS:
            prefix = ids + ours[:same]
            assert ours[same] in _top5(hf_bf16, prefix), (prompt, same)
            assert theirs[same] in _our_top5(llm, prefix), (prompt, same)
    # Not a lucky top-5 walk: most of the tokens agree exactly.
    assert agreed >= len(PROMPTS) * NEW_TOKENS // 2, agreed


def assert_stack_equals_per_op(model: str, prompts: list[list[int]], monkeypatch,
                               dtype: str = "bfloat16") -> None:
    """Greedy decoding of the prompts in dtype, all in one batch and one alone: the one-call
    stack runs every decode step and gives the per-op forward's tokens and logprobs. (dtype
    "auto": a GGUF's weights kept quantized, with bf16 or fp32 activations as the CPU
    has them.)"""
    assert build.load() is not None, build.load_error
    kwargs = dict(dtype=dtype, kv_cache_memory_bytes=16 * 2**20, max_model_len=512,
                  enable_prefix_caching=False)
    llm = LLM(model, **kwargs)
    activations = llm.engine.model_runner.dtype
    if not CpuDecodeStack.runs_here(activations):
        pytest.skip(f"the decode stack does not run {activations} here (bf16: AVX512-BF16; "
                    f"fp32: AVX-512 or AVX2 kernels)")
    assert llm.engine.model_runner.decode_stack is not None
    eager = LLM(model, enforce_eager=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    counts = counting_stack_steps(monkeypatch)
    for batch in (prompts, prompts[:1]):
        counts["stack"] = 0
        ours = llm.generate(batch, params, use_tqdm=False)
        assert counts["stack"] == 11
        per_op = eager.generate(batch, params, use_tqdm=False)
        for a, b in zip(ours, per_op):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.slow
def test_fused_decode_stack_gives_the_per_op_forwards_tokens_and_logprobs(monkeypatch):
    """bf16 decode steps run the whole layer stack as one C++ call
    (engine/cpu_decode_stack.py): the same kernels in the same order (pagedllm's packed
    linear at every row count where the CPU has AVX512-BF16 and no AMX; else the
    weight-streaming linear up to small_linear_rows() rows, oneDNN's beyond), so the same
    tokens and logprobs as the per-op forward (enforce_eager=True), bit for bit. (Prefix
    caching is off: a cached prompt takes another bf16 rounding path in prefill, on either
    side.)"""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the fused decode stack needs a CPU with AVX512-BF16")
    assert build.load() is not None, build.load_error  # a build failure fails the test
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
              enable_prefix_caching=False)
    eager = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
                enable_prefix_caching=False, enforce_eager=True)
    assert eager.engine.model_runner.decode_stack is None
    small = probes.small_linear_rows()
    lengths = [15, 16, 17, 40, 3, 33, 64] * 3  # around block boundaries
    prompts = [[1000 + 37 * i + j for j in range(length)] for i, length in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    counts = counting_stack_steps(monkeypatch)
    for rows in (1, small, small + 1):  # each kernel of the linears
        counts["stack"] = 0
        ours = llm.generate(prompts[:rows], params, use_tqdm=False)
        assert counts["stack"] == 19  # every decode step (the first token comes from the prefill)
        per_op = eager.generate(prompts[:rows], params, use_tqdm=False)
        assert counts["stack"] == 19
        for a, b in zip(ours, per_op):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_fused_decode_stack_sees_a_hook_or_a_rebound_cache_added_after_its_first_step(llm):
    """The one-call stack's arguments are gathered once and checked by identity each step:
    a forward hook put on one layer sends the decode steps back to the per-op forward (the
    hook runs in every step) and, removed, lets the same gathered stack take them again; a
    layer's KV cache rebound to another tensor makes the stack gather anew, with it."""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the fused decode stack needs a CPU with AVX512-BF16")
    assert build.load() is not None, build.load_error
    executor = llm.engine.model_runner.decode_stack
    model = llm.engine.model_runner.model.model
    prompt = [[1000 + 7 * j for j in range(20)]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    stack = executor.args
    assert stack is not None  # the decode steps took the one-call stack
    calls = 0

    def hook(module, args, output):
        nonlocal calls
        calls += 1

    handle = model.layers[17].register_forward_hook(hook)
    try:
        hooked = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        handle.remove()
    assert calls == 6  # the prefill and all 5 decode steps ran layer 17 as a module
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert executor.args is stack
    assert hooked == first and again == first
    attn = model.layers[3].self_attn.attn
    cache = attn.k_cache
    attn.k_cache = cache.clone()
    try:
        assert not stack.current()
        rebound = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert executor.args.k_caches[3] is attn.k_cache
    finally:
        attn.k_cache = cache
    assert rebound == first


@pytest.mark.slow
def test_fused_decode_stack_with_cascade_attention_gives_the_per_op_forwards_results(monkeypatch):
    """Rows sharing a cached 320-token prefix decode with cascade attention; the one-call
    stack then runs the prefix part too (the same attention kernel as cpu_paged's, merged by the
    paged kernel): tokens and logprobs equal the per-op forward's (enforce_eager=True), both
    when the prefix's blocks are adjacent (a view of the cache) and when they are taken as a
    copy. Each run has an engine of its own, so all prefill alike (prefix caching on)."""
    from pagedllm.attention import cpu_paged
    assert build.load() is not None, build.load_error
    if not cpu_paged.attention_kernel(torch.bfloat16, 64):
        pytest.skip("cascade steps take the one-call stack only with the attention kernel (AVX512-BF16)")
    prefix = [2000 + (7 * j) % 5000 for j in range(320)]
    prompts = [prefix + [100 + 11 * i + j for j in range(5 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    counts = counting_stack_steps(monkeypatch)
    counts["cascade"] = 0
    plan = cpu_paged.decode_plan

    def counting_plan(ctx, n, block_size, cascade=True):
        result = plan(ctx, n, block_size, cascade)
        counts["cascade"] += bool(result.prefixes)
        return result

    monkeypatch.setattr(cpu_paged, "decode_plan", counting_plan)
    results = {}
    for mode in ("fused", "fused_copied", "per_op"):
        if mode == "fused_copied":  # the prefix's blocks as if they were not adjacent
            monkeypatch.setattr(cpu_paged.SharedPrefix, "cache_index",
                                property(lambda self: self.blocks))
        llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
                  enable_prefix_caching=True, enforce_eager=mode == "per_op")
        counts.update(stack=0, cascade=0)
        results[mode] = llm.generate(prompts, params, use_tqdm=False)
        if mode != "per_op":
            assert counts["stack"] == 11 and counts["cascade"] >= 11, counts
        else:
            assert counts["stack"] == 0
        del llm
    for mode in ("fused", "fused_copied"):
        for a, b in zip(results[mode], results["per_op"]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, mode
            assert a.outputs[0].logprobs == b.outputs[0].logprobs, mode


def _prefill_hidden(llm: LLM, prompts: list[list[int]], keep_rows: torch.Tensor | None
                    ) -> torch.Tensor:
    """The model's final hidden states for one prefill of the prompts (no KV cache bound:
    attention over each prompt itself): every token's, or the rows keep_rows indexes."""
    from pagedllm.attention.context import reset_context, set_context
    runner = llm.engine.model_runner
    caches = [(m, m.k_cache, m.v_cache) for m in runner.model.modules() if hasattr(m, "k_cache")]
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    try:
        for m, _, _ in caches:
            m.k_cache = m.v_cache = torch.tensor([])
        set_context(is_prefill=True, seqlens_q=lens, seqlens_k=lens)
        with torch.inference_mode():
            return runner.model(ids, positions, keep_rows)
    finally:
        reset_context()
        for m, k, v in caches:
            m.k_cache, m.v_cache = k, v


def test_kept_rows_are_those_of_the_whole_forward(llm):
    """DecoderModel.forward(keep_rows=...) runs the last layer past its attention on the
    kept rows only: its outputs are the whole forward's rows, in keep_rows' order
    (repeats included), up to bf16 rounding (a different kernel may take fewer rows)."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    rows = torch.stack([ends[2], ends[0], ends[2], torch.tensor(3)])
    whole = _prefill_hidden(llm, prompts, None)
    kept = _prefill_hidden(llm, prompts, rows)
    assert kept.shape == (len(rows), whole.shape[1])
    # a wrong or misordered row is off by the states' own size; rounding by far less
    assert (kept.float() - whole[rows].float()).abs().max() <= 0.02 * whole.float().abs().max()
    model = llm.engine.model_runner.model
    assert torch.equal(model.compute_logits(kept).argmax(-1),
                       model.compute_logits(whole[rows]).argmax(-1))


def test_prompt_steps_run_the_last_layer_on_the_sampled_rows_only(llm, monkeypatch):
    """A step with prompts (bf16) samples one token per prompt: its last layer's MLP sees
    those rows only, the first layer's every token (whose k and v every layer caches)."""
    first, last = llm.engine.model_runner.model.model.layers[0], \
        llm.engine.model_runner.model.model.layers[-1]
    seen: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", first), ("last", last)):
        forward = layer.mlp.forward
        monkeypatch.setattr(layer.mlp, "forward",
                            lambda x, forward=forward, name=name: seen[name].append(x.shape[0])
                            or forward(x))
    lengths = [40, 70, 100]
    prompts = [[1000 + 13 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1, 1]
    assert seen == {"first": [sum(lengths)], "last": [len(lengths)]}
    runner = llm.engine.model_runner
    assert runner._keeps_rows(torch.tensor([5, 9]), 10)
    assert not runner._keeps_rows(torch.arange(10), 10)  # decode: every row is sampled
    assert not runner._keeps_rows(torch.tensor([], dtype=torch.int64), 10)
    monkeypatch.setattr(runner, "dtype", torch.float32)  # fp32 keeps HF's kernels' rounding
    assert not runner._keeps_rows(torch.tensor([5, 9]), 10)
