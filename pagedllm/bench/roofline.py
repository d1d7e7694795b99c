"""The cost of a workload from the model config, and the fastest the machine could run it.

A token through the decoder body costs 2 FLOPs per weight of every linear layer; every
output token needs one LM-head pass (2 * hidden * vocab), prompt tokens need none (logits
only for the last one, which yields the first output token). Attention adds
4 * heads * head_dim FLOPs per layer for every (query, key) pair it scores (QK^T and PV).

The roofline of a workload is the larger of two lower bounds:
  compute: all FLOPs at the measured matmul peak of the dtype;
  memory:  the weights read once per decode step (at least max output length - 1 steps)
           plus every decode token reading its whole context's K and V, at the measured
           memory bandwidth.
A mixture of experts computes, per token, its top-k experts of each sparse layer (plus its
router and shared expert); a decode step of R rows reads the experts they route to, under
uniform routing E (1 - (1 - k/E)^R) of each layer's E on average (k for one row, nearly all
of them for a batch), with R the workload's decode tokens over its decode steps.
It assumes the compute-bound work (prompts) and the memory-bound work (decode) overlap
perfectly. The serial bound does not: the prompts' FLOPs at the peak, then the decode at
its own roofline (a request's decode cannot start before its prompt, and on a CPU the same
cores do both). An engine that runs every kernel at the machine's limit but never overlaps
the two reaches the serial bound, not the roofline.
Work shared between requests (W3's common prefix) is counted once: the roofline belongs
to the workload, not to an engine's choices.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedllm.bench.workloads import BenchRequest, Workload
from pagedllm.models.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    body_flops_per_token: float   # every decoder layer's linear layers (a token's experts)
    head_flops_per_token: float   # the LM head
    attn_flops_per_pair: float    # one (query, key) pair over all layers
    weight_params: int            # parameters read by one row's decode step (body + LM head)
    kv_elements_per_token: int    # K and V of one token over all layers
    expert_params: int = 0        # one routed expert of every sparse layer (0: dense)
    num_experts: int = 0
    experts_per_token: int = 0
    kv_vectors_per_token: int = 0  # head vectors of K and V of one token over all layers

    def kv_bytes_per_token(self, kv_cache: str | None, itemsize: int) -> float:
        """Bytes one token's K and V take in a cache of type kv_cache: pagedllm's
        kv_cache_dtype or llama.cpp's cache type; None or "auto": itemsize bytes an element.
        An int8 cache adds a 4-byte scale a vector, llama.cpp's q8_0 2 bytes a 32."""
        per_element = {"float32": 4, "f32": 4, "bfloat16": 2, "float16": 2, "f16": 2,
                       "q8_0": 34 / 32}.get(kv_cache or "", itemsize)
        if kv_cache == "int8":
            return self.kv_elements_per_token + 4 * self.kv_vectors_per_token
        return per_element * self.kv_elements_per_token

    @property
    def prompt_flops_per_token(self) -> float:
        return self.body_flops_per_token

    @property
    def output_flops_per_token(self) -> float:
        return self.body_flops_per_token + self.head_flops_per_token

    @property
    def total_weight_params(self) -> int:
        """Every parameter of the linear layers and the LM head, all experts included."""
        return self.weight_params + (self.num_experts - self.experts_per_token) * self.expert_params

    def step_weight_params(self, rows: float) -> float:
        """Parameters a decode step of `rows` rows reads: all of a dense model's; of each
        sparse layer's experts, those uniform routing reaches on average."""
        if not self.num_experts:
            return self.weight_params
        e, k = self.num_experts, self.experts_per_token
        reached = e * (1.0 - (1.0 - k / e) ** max(rows, 1.0))
        return self.weight_params + (reached - k) * self.expert_params

    def summary(self) -> dict:
        return {**asdict(self), "gflop_per_prompt_token": self.prompt_flops_per_token / 1e9,
                "gflop_per_output_token": self.output_flops_per_token / 1e9}


def model_cost(mc: ModelConfig) -> ModelCost:
    h, d = mc.hidden_size, mc.head_dim
    q_out, kv_out = mc.num_attention_heads * d, mc.num_key_value_heads * d
    attn_params = h * q_out + 2 * h * kv_out + q_out * h
    sparse = sum(mc.is_moe_layer(i) for i in range(mc.num_hidden_layers))
    dense_mlp = 3 * h * mc.intermediate_size  # gate, up, down
    expert = 3 * h * mc.moe_intermediate_size if sparse else 0
    shared = mc.shared_expert_intermediate_size
    # a sparse layer's router, its shared expert and the shared expert's gate
    sparse_fixed = h * mc.num_experts + (3 * h * shared + h if shared else 0)
    k = mc.num_experts_per_tok if sparse else 0
    body_params = (mc.num_hidden_layers * attn_params + (mc.num_hidden_layers - sparse) * dense_mlp
                   + sparse * (sparse_fixed + k * expert))
    head_params = h * mc.vocab_size
    return ModelCost(
        body_flops_per_token=2.0 * body_params,
        head_flops_per_token=2.0 * head_params,
        attn_flops_per_pair=4.0 * mc.num_hidden_layers * q_out,
        weight_params=body_params + head_params,
        kv_elements_per_token=2 * mc.num_hidden_layers * kv_out,
        kv_vectors_per_token=2 * mc.num_hidden_layers * mc.num_key_value_heads,
        expert_params=sparse * expert,
        num_experts=mc.num_experts if sparse else 0,
        experts_per_token=k)


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo+1) + ... + hi (0 when hi < lo)."""
    return (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0


def request_prompt_flops(cost: ModelCost, r: BenchRequest, cached_prefix: int = 0) -> float:
    """FLOPs of a request's prompt: its new prompt tokens through the body, their
    attention, and the LM head for the first output token."""
    p = r.prompt_len
    return ((p - cached_prefix) * cost.body_flops_per_token + cost.head_flops_per_token
            + _sum_range(cached_prefix + 1, p) * cost.attn_flops_per_pair)


def request_flops(cost: ModelCost, r: BenchRequest, cached_prefix: int = 0) -> float:
    """FLOPs of one request whose first ``cached_prefix`` prompt tokens are already computed.

    Prefill runs the new prompt tokens and yields the first output token; each further
    output token is one decode step (body + head), so output_len - 1 decode tokens.
    """
    p, o = r.prompt_len, r.output_len
    body_tokens = (p - cached_prefix) + (o - 1)
    # Query at position i (1-based) attends to i keys.
    pairs = _sum_range(cached_prefix + 1, p) + _sum_range(p + 1, p + o - 1)
    return (body_tokens * cost.body_flops_per_token + o * cost.head_flops_per_token
            + pairs * cost.attn_flops_per_pair)


def _cached_prefixes(workload: Workload) -> list[int]:
    """Per request, the prompt tokens it finds computed: the first request with a shared
    prefix pays for it, the others find it cached."""
    out, seen_prefix = [], False
    for r in workload.requests:
        out.append(r.shared_prefix_len if seen_prefix else 0)
        seen_prefix = seen_prefix or r.shared_prefix_len > 0
    return out


def workload_flops(cost: ModelCost, workload: Workload) -> float:
    """Total FLOPs, with a prefix shared by several requests computed only once."""
    return sum(request_flops(cost, r, c)
               for r, c in zip(workload.requests, _cached_prefixes(workload)))


def workload_prompt_flops(cost: ModelCost, workload: Workload) -> float:
    """The part of workload_flops that processes prompts (up to each first output token)."""
    return sum(request_prompt_flops(cost, r, c)
               for r, c in zip(workload.requests, _cached_prefixes(workload)))


def workload_min_bytes(cost: ModelCost, workload: Workload, itemsize: int,
                       kv_cache: str | None = None) -> float:
    """Bytes that must cross the memory bus at least: weights per decode step, K/V per
    decode token (in a cache of type kv_cache: ModelCost.kv_bytes_per_token)."""
    decode_steps = max(r.output_len for r in workload.requests) - 1
    decode_tokens = sum(r.output_len - 1 for r in workload.requests)
    kv_reads = sum(_sum_range(r.prompt_len + 1, r.prompt_len + r.output_len - 1)
                   for r in workload.requests)
    rows = decode_tokens / decode_steps if decode_steps else 1.0
    return (itemsize * decode_steps * cost.step_weight_params(rows)
            + kv_reads * cost.kv_bytes_per_token(kv_cache, itemsize))


@dataclass(frozen=True)
class Roofline:
    flops: float
    min_bytes: float
    peak_gflops: float
    bandwidth_gbs: float
    prompt_flops: float = 0.0  # the part of flops that processes prompts

    @property
    def compute_seconds(self) -> float:
        return self.flops / (self.peak_gflops * 1e9)

    @property
    def memory_seconds(self) -> float:
        return self.min_bytes / (self.bandwidth_gbs * 1e9)

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def serial_seconds(self) -> float:
        """The prompts at the peak, then the decode at its own roofline."""
        prompt_s = self.prompt_flops / (self.peak_gflops * 1e9)
        decode_compute_s = (self.flops - self.prompt_flops) / (self.peak_gflops * 1e9)
        return prompt_s + max(decode_compute_s, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    def summary(self) -> dict:
        return {"gflop": self.flops / 1e9, "min_gbytes": self.min_bytes / 1e9,
                "peak_gflops": self.peak_gflops, "bandwidth_gbs": self.bandwidth_gbs,
                "compute_seconds": self.compute_seconds, "memory_seconds": self.memory_seconds,
                "seconds": self.seconds, "bound": self.bound,
                "prompt_gflop": self.prompt_flops / 1e9, "serial_seconds": self.serial_seconds}


def workload_roofline(cost: ModelCost, workload: Workload, itemsize: int, peak_gflops: float,
                      bandwidth_gbs: float, kv_cache: str | None = None) -> Roofline:
    return Roofline(workload_flops(cost, workload),
                    workload_min_bytes(cost, workload, itemsize, kv_cache),
                    peak_gflops, bandwidth_gbs, workload_prompt_flops(cost, workload))


def decode_step_roofline_seconds(cost: ModelCost, context_len: int, itemsize: int,
                                 peak_gflops: float, bandwidth_gbs: float,
                                 weight_bytes: float | None = None,
                                 kv_cache: str | None = None) -> float:
    """Fastest single-stream decode step at a given context length (W2's decode bound).
    weight_bytes: what the engine's weights take (all experts) if not itemsize bytes a
    parameter (quantized weights); kv_cache: the cache's type (kv_bytes_per_token)."""
    flops = cost.output_flops_per_token + context_len * cost.attn_flops_per_pair
    if weight_bytes is None:
        weight_bytes = itemsize * cost.weight_params
    else:  # of a mixture of experts, the step reads its k experts' share
        weight_bytes *= cost.weight_params / cost.total_weight_params
    nbytes = weight_bytes + context_len * cost.kv_bytes_per_token(kv_cache, itemsize)
    return max(flops / (peak_gflops * 1e9), nbytes / (bandwidth_gbs * 1e9))


def prefill_roofline_seconds(cost: ModelCost, prompt_len: int, peak_gflops: float) -> float:
    """Fastest time to first token: the prompt's FLOPs plus one LM head at peak."""
    flops = (prompt_len * cost.body_flops_per_token + cost.head_flops_per_token
             + _sum_range(1, prompt_len) * cost.attn_flops_per_pair)
    return flops / (peak_gflops * 1e9)
