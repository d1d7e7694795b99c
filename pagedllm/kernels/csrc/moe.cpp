// A mixture-of-experts block's routed experts in one call: the step's (token, expert) pairs
// grouped by expert, each chosen expert's MLP run once over its tokens (its weights read
// once per step however many tokens chose it), the results scaled by the routing weights
// and summed into each token's row.
//
// It runs what layers/moe.py FusedMoE.forward_grouped runs, in the same order on the same
// tensors, so the results are the same bit for bit: the pairs sorted by expert (tokens in
// order within an expert), an expert's rows gathered, gate/up by the expert's linear,
// silu_and_mul, down, then out[t] = T(out[t] + T(y * w)) expert after expert in the rows'
// dtype T, bf16 or fp32 (torch's multiply and index_add_ round the same way). Experts packed
// for pagedllm's bf16 kernel run gate/up and silu_and_mul as one packed_gate_up_silu_bf16
// (the same results as the two ops). What it
// saves is the Python and torch dispatch around ~7 ops per chosen expert: Qwen3-30B-A3B
// chooses 8 of 128 per token, so a step of 16 rows runs ~100 experts in each of its 48
// layers.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

namespace pagedllm {
namespace {

// x w^T for one expert's projection: GGUF parts kept quantized, a bf16 weight packed for
// pagedllm's kernel (layers/moe.py FusedMoE.packed), else the plain bf16 weight streamed by
// small_linear_bf16 up to small_rows rows and torch's linear beyond (select_expert_linear).
at::Tensor expert_linear(const at::Tensor& x, const StackLinear& l, int64_t small_rows) {
  if (!l.parts.empty()) return gguf_parts_linear(x, l);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moe_experts: fp32 rows take GGUF experts only");
  if (l.packed.dim() == 4) return packed_linear_bf16(x, l.packed, false);
  if (x.size(0) <= small_rows) return small_linear_bf16(x, l.weight);
  return at::linear(x, l.weight);
}

// silu(gate) * up of an expert's [gate; up] projection: in one pass from a packed weight
// (the same results as the linear then silu_and_mul).
at::Tensor expert_gate_up(const at::Tensor& x, const StackLinear& l, int64_t small_rows) {
  if (l.parts.empty() && l.packed.dim() == 4) return packed_gate_up_silu_bf16(x, l.packed);
  return silu_and_mul(expert_linear(x, l, small_rows));
}

// out[r[i]] = T(out[r[i]] + T(y[i] * w[pair i])) for an expert's rows i, in order.
template <typename T>
void add_scaled_rows(at::Tensor& out, const at::Tensor& y, const int64_t* r, const float* w,
                     const std::vector<int64_t>& pairs) {
  const int64_t hidden = out.size(1);
  T* o = out.data_ptr<T>();
  const T* yv = y.data_ptr<T>();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const float scale = w[pairs[i]];
    T* dst = o + r[i] * hidden;
    const T* src = yv + i * hidden;
    for (int64_t j = 0; j < hidden; ++j) {
      const T scaled(static_cast<float>(src[j]) * scale);
      dst[j] = T(static_cast<float>(dst[j]) + static_cast<float>(scaled));
    }
  }
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const std::vector<StackLinear>& gate_up,
                       const std::vector<StackLinear>& down, int64_t small_rows) {
  const bool fp32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || fp32) && x.is_contiguous(),
              "moe_experts: x must be contiguous bf16 or fp32 [T, hidden]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "moe_experts: ids must be int64 [T, top_k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_experts: weights must be float32 like ids");
  TORCH_CHECK(gate_up.size() == down.size() && !gate_up.empty(),
              "moe_experts: one gate/up and one down projection per expert");
  const int64_t tokens = x.size(0), top_k = ids.size(1);
  const int64_t experts = static_cast<int64_t>(gate_up.size());
  const at::Tensor ids_c = ids.contiguous(), weights_c = weights.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const float* w = weights_c.data_ptr<float>();
  // the pairs of each expert in flat (token-major) order: a stable sort by expert
  std::vector<std::vector<int64_t>> pairs(experts);
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    TORCH_CHECK(0 <= id[p] && id[p] < experts, "moe_experts: expert id ", id[p],
                " out of range for ", experts, " experts");
    pairs[id[p]].push_back(p);
  }
  // Each chosen expert's MLP over its rows; y[e] its rows' outputs, in pair order.
  std::vector<int64_t> chosen;
  std::vector<at::Tensor> rows(experts), y(experts);  // rows[e]: the tokens of e's pairs
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = static_cast<int64_t>(pairs[e].size());
    if (count == 0) continue;
    chosen.push_back(e);
    most = std::max(most, count);
    rows[e] = at::empty({count}, ids.options());
    int64_t* r = rows[e].data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) r[i] = pairs[e][i] / top_k;
  }
  auto run_expert = [&](int64_t e) {
    const at::Tensor h = expert_gate_up(x.index_select(0, rows[e]), gate_up[e], small_rows);
    y[e] = expert_linear(h, down[e], small_rows).contiguous();
  };
  if (most <= small_rows && at::get_num_threads() > 1 && chosen.size() > 1) {
    // Few rows an expert (decode steps): the weights are read, hardly computed on. Each
    // expert is run by one thread, the threads taking experts from a shared counter, so a
    // thread streams whole experts one after another. Split between the threads instead,
    // every expert's two linears end in a barrier and restart both threads' streams:
    // Qwen3-30B-A3B's Q4_K experts (2.7 MB each) took 0.57 / 2.0 / 6.2 ms a layer at
    // 1 / 4 / 16 rows that way, 0.53-0.57 / 1.86-1.97 / 5.75-5.81 ms this way. The linears'
    // own parallel loops run inline here (nested), and an expert's results do not depend
    // on which thread ran it.
    std::atomic<size_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (size_t i = next++; i < chosen.size(); i = next++) run_expert(chosen[i]);
    });
  } else {
    for (int64_t e : chosen) run_expert(e);
  }
  // the weighted sums, expert after expert as before
  at::Tensor out = at::zeros_like(x);
  for (int64_t e : chosen) {
    const int64_t* r = rows[e].data_ptr<int64_t>();
    if (fp32)
      add_scaled_rows<float>(out, y[e], r, w, pairs[e]);
    else
      add_scaled_rows<c10::BFloat16>(out, y[e], r, w, pairs[e]);
  }
  return out;
}

}  // namespace pagedllm
