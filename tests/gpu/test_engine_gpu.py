"""The engine on an NVIDIA GPU, against HF transformers run on the same GPU.

fp32 greedy tokens equal HF's for the bundled SmolLM2 and a tiny random model of every
family the engine supports; a CUDA-graph replay equals the eager forward at the padded batch
size, bit for bit; bf16 passes vLLM's closeness rule; prefix caching, chunked prefill,
preemption (recompute and swap), n = 2 and beam search keep the greedy tokens; sampling
runs on the device (seeded draws reproducible in any batch); the KV cache is sized from a
profiled warm-up; the C++ CPU extension is never built; NCCL initialises; `pagedllm serve`
answers the openai client. Skipped without a GPU (conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gpu_harness import DEVICE, hf_greedy_cuda, load_test_module, suite_tokenizer
from family_harness import (PROMPT_TEXTS, SETTINGS, Family, build, first_difference,
                            kv_bytes_for_blocks)
from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model_source

NEW_TOKENS = 24
# Small enough that graph capture is quick (batch sizes 1, 2, 4, 8, 16).
GPU_OPTIONS = dict(device=DEVICE, max_num_seqs=16, max_model_len=512)
ON_GPU = DEVICE == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="a GPU feature (dry run on the CPU)")

QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "qwen3",
               dict(tie_word_embeddings=False, rope_theta=10000.0),
               sizes=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          max_position_embeddings=512))
LLAMA = Family("llama", "LlamaForCausalLM", "LlamaConfig", "llama", dict(tie_word_embeddings=True))


def _all_families() -> dict[str, Family]:
    families = {"qwen3": QWEN3, "llama": LLAMA}
    for module in ("models/test_families.py", "models/test_gemma.py", "models/test_moe.py"):
        families.update(load_test_module(module).FAMILIES)
    return families


FAMILIES = _all_families()


def greedy(n: int = NEW_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=logprobs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name) -> (Built, prompt ids, HF's fp32 greedy tokens on the GPU), once each."""
    root = tmp_path_factory.mktemp("gpu-families")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            built = build(FAMILIES[name], root, suite_tokenizer())
            tok = load_model_source(str(built.hf_dir)).tokenizer   # (no CPU engine here)
            prompts = [tok.encode(p) for p in PROMPT_TEXTS]
            hf = eager_attention(built.hf.to(DEVICE))
            cache[name] = built, prompts, hf_greedy_cuda(hf, prompts, NEW_TOKENS)
            built.hf.to("cpu")
        return cache[name]
    return get


def eager_attention(model):
    """HF's attention written out in torch ops (its "eager" implementation), the exact math
    of every family's options: on CUDA its default SDPA kernels may not take them all
    (soft-capping)."""
    model.set_attn_implementation("eager")
    return model


def cuda_llm(path: str, **options) -> LLM:
    return LLM(path, **{**GPU_OPTIONS, "dtype": "float32", "check_invariants": True, **options})


def test_smoke_tiny_llama_graphs_equal_eager(tiny_gguf):
    """The whole CUDA path on a tiny Llama that needs nothing but this repository: prompts,
    chunked prompts, decode steps replayed from graphs and run eagerly, equal tokens."""
    import gc
    prompts = [[1, 5, 9, 20], [1, 7, 8] * 10, list(range(4, 200))]
    outs = {}
    for eager in (False, True):
        llm = cuda_llm(str(tiny_gguf), enforce_eager=eager, max_model_len=256,
                       max_num_batched_tokens=64)
        assert (llm.engine.model_runner.graphs is None) == (eager or not ON_GPU)
        outs[eager] = [o.token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
        del llm
        gc.collect()
    assert outs[False] == outs[True]
    assert all(len(t) == 16 for t in outs[False])


@needs_gpu
def test_cpu_extension_is_never_built(models):
    """The CUDA path never builds or calls the C++ CPU kernels: an engine in a fresh process
    (this one's test modules may have asked for them) loads, samples with every option and
    leaves them unloaded."""
    import subprocess
    import sys
    built, prompts, _ = models("qwen3")
    script = (
        "from pagedllm import LLM, SamplingParams\n"
        "from pagedllm.kernels import build\n"
        f"llm = LLM({str(built.hf_dir)!r}, device='cuda', max_num_seqs=16, max_model_len=512)\n"
        "sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=1, "
        "max_tokens=8, logprobs=2, repetition_penalty=1.1)\n"
        f"llm.generate({prompts[:2]!r}, sp, use_tqdm=False)\n"
        f"llm.generate({prompts[:2]!r}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)\n"
        "assert build._ext is None and build.load_error is None, (build._ext, build.load_error)\n"
        "print('never built')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "never built" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fp32_greedy_equals_hf_on_the_gpu(models, name):
    built, prompts, reference = models(name)
    llm = cuda_llm(str(built.hf_dir))
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for ids, out, ref in zip(prompts, outs, reference):
        assert out.token_ids == ref, f"{name} prompt {ids[:6]}: ours {out.token_ids} vs HF {ref}"
    runner = llm.engine.model_runner
    if ON_GPU:
        assert runner.attention_backend in ("triton", "flash")
        assert (runner.graphs is not None) or name in ("qwen3-moe", "qwen2-moe", "mixtral")


def test_bundled_model_fp32_greedy_equals_hf_on_the_gpu(gguf_path):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval().to(DEVICE)
    llm = cuda_llm(str(gguf_path))
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPT_TEXTS]
    reference = hf_greedy_cuda(hf, prompts, 32)
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("setting", ["prefix-cache", "preempt", "swap", "chunked"])
def test_settings_keep_greedy_tokens(models, setting):
    built, prompts, reference = models("qwen3")
    options = SETTINGS[setting](built)
    llm = cuda_llm(str(built.hf_dir), **options)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    scheduler = llm.engine.scheduler
    if setting == "prefix-cache":
        hits = scheduler.block_manager.num_hit_tokens
        again = llm.generate(prompts, greedy(), use_tqdm=False)
        assert scheduler.block_manager.num_hit_tokens > hits
        assert [o.token_ids for o in again] == reference
    if setting in ("preempt", "swap"):
        assert scheduler.num_preemptions > 0
    if setting == "swap":
        assert scheduler.num_swap_outs > 0
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_n2_and_beam_search(models):
    built, prompts, reference = models("qwen3")
    llm = cuda_llm(str(built.hf_dir))
    out = llm.generate(prompts[:3], SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS,
                                                   min_tokens=NEW_TOKENS), use_tqdm=False)
    for o, ref in zip(out, reference):
        assert [c.token_ids for c in o.outputs] == [ref, ref]
    hf = built.hf.to(DEVICE)
    ours = llm.beam_search(prompts[:3], beam_width=2, max_tokens=12, use_tqdm=False)
    for ids, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=DEVICE), num_beams=2, do_sample=False,
                              early_stopping=False, max_new_tokens=12, pad_token_id=2)
        assert o.outputs[0].token_ids == ref[0, len(ids):].tolist()
    built.hf.to("cpu")


@needs_gpu
def test_graph_replay_equals_eager_bit_for_bit(models):
    """A decode batch of 3 rows replayed in the 4-row graph equals the eager forward of the
    same 4 padded rows (slot -1, context 0) through the same static buffers."""
    from pagedllm.attention.context import reset_context
    built, prompts, _ = models("qwen3")
    llm = cuda_llm(str(built.hf_dir), dtype="bfloat16")
    llm.generate(prompts[:3], greedy(8), use_tqdm=False)   # some KV to attend to
    runner = llm.engine.model_runner
    graphs = runner.graphs
    assert graphs is not None and 4 in graphs.batch_sizes
    g = torch.Generator().manual_seed(0)
    n, bs = 3, 4
    width = graphs.block_tables.shape[1]
    with torch.inference_mode():
        graphs.input_ids[:n] = torch.randint(0, 1000, (n,), generator=g).to(DEVICE)
        graphs.positions[:n] = torch.tensor([20, 33, 7]).to(DEVICE)
        graphs.context_lens.zero_()
        graphs.context_lens[:n] = graphs.positions[:n] + 1
        graphs.slot_mapping.fill_(-1)     # store nothing: the cache stays as it is
        graphs.block_tables.fill_(-1)
        graphs.block_tables[:n, :3] = torch.arange(9).view(3, 3).to(DEVICE)
        graphs.graphs[bs].replay()
        replayed = graphs.outputs[:bs].clone()
        graphs._set_context(bs)
        try:
            eager = runner.model(graphs.input_ids[:bs], graphs.positions[:bs])
        finally:
            reset_context()
    assert width == graphs.block_tables.shape[1]
    assert torch.equal(replayed[:n], eager[:n])


def test_bf16_close_to_hf_bf16(models):
    """vLLM's rule: where our bf16 greedy tokens and HF's bf16 ones first differ, each side's
    token is among the other's top-5."""
    built, prompts, _ = models("qwen3")
    hf = type(built.hf).from_pretrained(str(built.hf_dir), dtype=torch.bfloat16).eval().to(DEVICE)
    theirs = hf_greedy_cuda(hf, prompts, NEW_TOKENS)
    llm = cuda_llm(str(built.hf_dir), dtype="bfloat16")
    outs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    for ids, out, ref in zip(prompts, outs, theirs):
        i = first_difference(out.token_ids, ref)
        if i is None:
            continue
        our_top5 = {t for t, _ in out.outputs[0].logprobs[i].top}
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ref[:i]], device=DEVICE)).logits[0, -1].float()
        assert ref[i] in our_top5 and out.token_ids[i] in set(logits.topk(5).indices.tolist())


def test_sampling_on_the_device(models):
    """Seeded draws are the same alone and in a batch; penalties, top-k / top-p / min-p and
    logprobs run on the device and keep their meaning."""
    built, prompts, _ = models("qwen3")
    llm = cuda_llm(str(built.hf_dir))
    assert llm.engine.model_runner.generator.device.type == DEVICE
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=7,
                            max_tokens=16, logprobs=3, repetition_penalty=1.2,
                            frequency_penalty=0.5, presence_penalty=0.3)
    alone = llm.generate([prompts[2]], seeded, use_tqdm=False)[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16)
    batch = llm.generate([prompts[0], prompts[2], prompts[1]], [unseeded, seeded, unseeded],
                         use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids
    lps = alone.outputs[0].logprobs
    assert len(lps) == 16 and all(len(lp.top) == 3 for lp in lps)
    assert all(lp.logprob <= 0 for lp in lps)
    # greedy with logprobs: the chosen token is the top logprob
    out = llm.generate([prompts[0]], greedy(8, logprobs=1), use_tqdm=False)[0]
    for t, lp in zip(out.token_ids, out.outputs[0].logprobs):
        assert lp.top[0][0] == t


@needs_gpu
def test_kv_cache_sized_from_a_profiled_warm_up(models, caplog):
    """vLLM's rule: gpu_memory_utilization x the GPU's memory, less what is in use after
    loading and the peak activations of a warm-up step at the full token budget."""
    from pagedllm.config import GPU_MAX_NUM_BATCHED_TOKENS
    built, _, _ = models("qwen3")
    with caplog.at_level("INFO"):
        llm = cuda_llm(str(built.hf_dir), gpu_memory_utilization=0.5, max_model_len=512,
                       max_num_seqs=256)
    runner = llm.engine.model_runner
    profile = runner.gpu_profile
    _, total = torch.cuda.mem_get_info()
    assert llm.engine.config.max_num_batched_tokens == GPU_MAX_NUM_BATCHED_TOKENS
    assert profile.num_tokens == GPU_MAX_NUM_BATCHED_TOKENS and profile.total == total
    assert profile.peak_activations > 0 and 0 < profile.weights < profile.used
    budget = profile.kv_bytes(0.5)
    assert budget == int(0.5 * total) - profile.used - profile.peak_activations > 0
    cap = 256 * 512 // 16
    assert runner.num_kvcache_blocks == min(budget // runner.kv_shape.block_bytes, cap)
    assert any("peak activations" in r.getMessage() for r in caplog.records)


@needs_gpu
def test_nccl_initialises_single_rank():
    """The tensor-parallel process group on NCCL (the path TP > 1 takes on CUDA): one rank
    here; an all-reduce runs on the device."""
    from pagedllm.distributed import DistInfo, destroy_distributed, free_port, init_distributed
    import torch.distributed as dist
    torch.cuda.set_device(0)
    init_distributed(DistInfo(0, 1, 0, 1, "127.0.0.1", free_port()), "nccl", 60.0)
    try:
        x = torch.ones(4, device=DEVICE)
        dist.all_reduce(x)
        assert x.tolist() == [1.0] * 4
        assert dist.get_backend() == "nccl"
    finally:
        destroy_distributed()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
def test_tensor_parallel_2_equals_hf(models):
    built, prompts, reference = models("qwen3")
    with LLM(str(built.hf_dir), device=DEVICE, dtype="float32", tensor_parallel_size=2,
             max_num_seqs=16, max_model_len=512) as llm:
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_serve_round_trip_with_openai_client(tmp_path, models):
    import subprocess
    import sys
    import socket
    import time
    import httpx
    openai = pytest.importorskip("openai")
    built, _, _ = models("qwen3")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                             "--model", str(built.hf_dir), "--port", str(port),
                             "--device", DEVICE, "--max-model-len", "512", "--max-num-seqs", "16"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "INFO"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert chat.choices[0].message.content
        stream = client.completions.create(model=client.models.list().data[0].id,
                                           prompt="Once upon a time", max_tokens=12,
                                           stream=True, temperature=0)
        assert "".join(c.choices[0].text for c in stream)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    log_text = (tmp_path / "server.log").read_text()
    if ON_GPU:
        assert "attention backend: triton" in log_text or "attention backend: flash" in log_text
