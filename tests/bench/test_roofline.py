"""The FLOP and byte model behind the roofline, checked against the model's real layers."""
from __future__ import annotations

import pytest
import torch

from pagedllm.bench.roofline import (model_cost, request_flops, request_prompt_flops,
                                     workload_flops, workload_min_bytes, workload_prompt_flops,
                                     workload_roofline)
from pagedllm.bench.workloads import BenchRequest, Workload
from pagedllm.loader import load_model_source
from pagedllm.models.registry import model_class


@pytest.fixture(scope="module")
def smollm_config():
    return load_model_source(None).config


def test_flops_per_token_equal_twice_the_linear_weights_of_the_real_model(smollm_config):
    with torch.device("meta"):
        model = model_class(smollm_config)(smollm_config)
    body = sum(p.numel() for n, p in model.named_parameters()
               if n.startswith("model.layers.") and p.dim() == 2)
    head = model.lm_head.weight.numel()
    cost = model_cost(smollm_config)
    assert cost.body_flops_per_token == 2 * body
    assert cost.head_flops_per_token == 2 * head
    # Issue 3's figures for SmolLM2-135M: ~0.21 GFLOP per prompt token, ~0.27 per generated one.
    assert round(cost.prompt_flops_per_token / 1e9, 2) == 0.21
    assert round(cost.output_flops_per_token / 1e9, 2) == 0.27


def test_request_flops_count_every_attention_pair_once(smollm_config):
    cost = model_cost(smollm_config)
    r = BenchRequest(list(range(3)), output_len=2)  # prefill 3 tokens, then 1 decode step
    # Queries at positions 1..3 see 1+2+3 keys; the decode query at position 4 sees 4.
    expected = (4 * cost.body_flops_per_token + 2 * cost.head_flops_per_token
                + (1 + 2 + 3 + 4) * cost.attn_flops_per_pair)
    assert request_flops(cost, r) == expected


def test_a_shared_prefix_is_paid_for_once(smollm_config):
    cost = model_cost(smollm_config)
    prefix = list(range(32))
    reqs = [BenchRequest(prefix + [100 + i], 1, shared_prefix_len=32) for i in range(3)]
    w = Workload("prefix", "", reqs)
    assert workload_flops(cost, w) == request_flops(cost, reqs[0]) + 2 * request_flops(cost, reqs[1], 32)


def test_roofline_is_the_slower_of_compute_and_memory(smollm_config):
    cost = model_cost(smollm_config)
    w = Workload("latency", "", [BenchRequest(list(range(128)), 256)])
    roof = workload_roofline(cost, w, itemsize=2, peak_gflops=367.0, bandwidth_gbs=30.0)
    assert roof.min_bytes == workload_min_bytes(cost, w, 2)
    assert roof.bound == "memory"  # one stream reads all weights per token
    assert roof.seconds == max(roof.compute_seconds, roof.memory_seconds)
    # 255 steps x ~0.27 GB of bf16 weights at 30 GB/s: a little over 2 s.
    assert 2.0 < roof.seconds < 2.6


def test_prompt_flops_are_the_prompt_tokens_their_attention_and_the_first_lm_head(smollm_config):
    cost = model_cost(smollm_config)
    r = BenchRequest(list(range(3)), output_len=2)
    assert request_prompt_flops(cost, r) == (3 * cost.body_flops_per_token + cost.head_flops_per_token
                                             + (1 + 2 + 3) * cost.attn_flops_per_pair)
    # Over a cached prefix of 2: one new token, which sees 3 keys.
    assert request_prompt_flops(cost, r, 2) == (cost.body_flops_per_token + cost.head_flops_per_token
                                                + 3 * cost.attn_flops_per_pair)
    # The rest of the request's FLOPs is its one decode step: body, head, 4 keys.
    assert request_flops(cost, r) - request_prompt_flops(cost, r) == (
        cost.body_flops_per_token + cost.head_flops_per_token + 4 * cost.attn_flops_per_pair)
    prefix = list(range(32))
    reqs = [BenchRequest(prefix + [100 + i], 1, shared_prefix_len=32) for i in range(3)]
    w = Workload("prefix", "", reqs)
    assert workload_prompt_flops(cost, w) == (request_prompt_flops(cost, reqs[0])
                                              + 2 * request_prompt_flops(cost, reqs[1], 32))


def test_serial_bound_is_the_prompts_at_the_peak_then_the_decode_roofline(smollm_config):
    cost = model_cost(smollm_config)
    reqs = [BenchRequest(list(range(512)), 64), BenchRequest(list(range(100)), 32)]
    w = Workload("throughput", "", reqs)
    peak, bw = 2000.0, 30.0
    roof = workload_roofline(cost, w, itemsize=2, peak_gflops=peak, bandwidth_gbs=bw)
    prompt_s = workload_prompt_flops(cost, w) / (peak * 1e9)
    decode_compute_s = (workload_flops(cost, w) - workload_prompt_flops(cost, w)) / (peak * 1e9)
    assert decode_compute_s < roof.memory_seconds  # the decode here is memory-bound
    assert roof.serial_seconds == pytest.approx(prompt_s + roof.memory_seconds)
    assert roof.serial_seconds > roof.seconds  # no overlap is slower than perfect overlap
    # With a slow enough peak the decode's own FLOPs bound it instead of its bytes.
    slow = workload_roofline(cost, w, itemsize=2, peak_gflops=1.0, bandwidth_gbs=bw)
    assert slow.serial_seconds == pytest.approx(slow.compute_seconds)
    assert roof.summary()["serial_seconds"] == roof.serial_seconds


def moe_config(preset: str, **changes):
    """The preset's config (random_model.py), as the HF loader reads its config.json."""
    import transformers
    from pagedllm.bench.random_model import _MODEL_CLASSES, PRESETS
    from pagedllm.loader.hf_loader import config_from_hf
    config_class, kwargs = PRESETS[preset]
    hf = getattr(transformers, config_class)(**{**kwargs, **changes}).to_dict()
    hf["architectures"] = [_MODEL_CLASSES[config_class]]
    return config_from_hf(hf, preset)


@pytest.mark.parametrize("preset,changes", [
    ("qwen3-30b-a3b-4layers", {}),
    ("qwen3-30b-a3b-4layers", {"mlp_only_layers": [1], "decoder_sparse_step": 1}),
    ("mixtral-8x7b-2layers", {})])
def test_a_mixture_of_experts_computes_its_top_k_experts_and_reads_those_it_reaches(preset, changes):
    config = moe_config(preset, **changes)
    shapes = model_class(config).checkpoint_shapes(config)
    linear = {n: s[0] * s[1] for n, s in shapes.items() if n.startswith("model.layers.") and len(s) == 2}
    experts = sum(v for n, v in linear.items() if ".experts." in n)
    rest = sum(linear.values()) - experts
    e, k = config.num_experts, config.num_experts_per_tok
    head = config.hidden_size * config.vocab_size
    cost = model_cost(config)
    assert cost.body_flops_per_token == 2 * (rest + k * experts // e)
    assert cost.weight_params == rest + k * experts // e + head
    assert cost.total_weight_params == rest + experts + head
    # one row reads its k experts; a batch reaches more, never more than all of them
    assert cost.step_weight_params(1) == pytest.approx(cost.weight_params)
    assert cost.weight_params < cost.step_weight_params(8) < cost.step_weight_params(64)
    assert cost.step_weight_params(10_000) == pytest.approx(cost.total_weight_params)
    # a workload's decode steps of 32 rows each read what 32 rows reach
    w = Workload("w1", "", [BenchRequest(list(range(16)), 9) for _ in range(32)])
    assert workload_min_bytes(cost, w, 2) == pytest.approx(
        2 * (8 * cost.step_weight_params(32)
             + 32 * sum(range(17, 25)) * cost.kv_elements_per_token))


def test_a_dense_model_reads_all_its_weights_whatever_the_rows(smollm_config):
    cost = model_cost(smollm_config)
    assert cost.total_weight_params == cost.weight_params == cost.step_weight_params(64)


def test_kv_bytes_follow_the_caches_type(smollm_config):
    """SmolLM2: 30 layers x 3 KV heads of 64, K and V. An int8 cache holds each vector's 64
    values and a 4-byte scale; llama.cpp's q8_0 34 bytes a 32; a bf16 cache under fp32
    activations 2 bytes a value, not the activations' 4."""
    cost = model_cost(smollm_config)
    vectors = 2 * 30 * 3
    assert cost.kv_vectors_per_token == vectors
    assert cost.kv_bytes_per_token("int8", 2) == vectors * 68
    assert cost.kv_bytes_per_token("q8_0", 2) == vectors * 64 * 34 / 32
    assert cost.kv_bytes_per_token("bfloat16", 4) == vectors * 64 * 2
    assert cost.kv_bytes_per_token(None, 4) == cost.kv_bytes_per_token("auto", 4) == vectors * 256
    # the same outputs after a long and a one-token prompt: the same weight reads, the
    # difference is K/V only
    long, short = (Workload("w", "", [BenchRequest(list(range(n)), 200)]) for n in (500, 1))
    kv16, kv8 = (workload_min_bytes(cost, long, 2, kv) - workload_min_bytes(cost, short, 2, kv)
                 for kv in ("bfloat16", "int8"))
    assert kv16 > 0 and kv8 == pytest.approx(kv16 * 68 / 128)
