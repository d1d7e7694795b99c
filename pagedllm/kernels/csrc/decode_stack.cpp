// A decode step's whole stack of decoder layers, in one call.
//
// It runs the kernels the model's Python forward runs (models/llama.py with the CPU ops:
// rms_norm, packed_linear_bf16, q4_1_linear_bf16, small_linear_bf16, amx_linear_bf16 or oneDNN's matmul on the
// prepacked weight, rotary_embedding, store_kv, paged_attention, silu_and_mul), in the same
// order on the same tensors, so its results are the same bit for bit. What it saves is the
// Python and torch dispatch around ~12 ops a layer: about 1 ms a step (measured at one row:
// 14.6 -> 13.75 ms).
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace pagedllm {
namespace {

// x w^T: pagedllm's packed linear where the weight is packed for it (a GGUF Q4_1 weight:
// q4_1_linear_bf16); else the
// weight-streaming kernel for up to small_rows rows, the AMX one up to amx_rows, oneDNN's
// matmul on the prepacked weight beyond (as layers/linear_methods.py chooses).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                  int64_t small_rows, int64_t amx_rows) {
  if (packed.dim() == 4)
    return packed.scalar_type() == at::kByte ? q4_1_linear_bf16(x, packed) : packed_linear_bf16(x, packed);
  if (x.size(0) <= small_rows) return small_linear_bf16(x, w);
  if (x.size(0) <= amx_rows && x.size(1) % 32 == 0 && w.size(0) % 32 == 0)
    return amx_linear_bf16(x, w);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x.contiguous(), packed, std::nullopt, "none",
                 c10::List<std::optional<at::Scalar>>(), "");
}

}  // namespace

at::Tensor decode_layers(at::Tensor x, const at::Tensor& positions,
                         const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& k_caches,
                         const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& q_starts,
                         const at::Tensor& q_lens, const at::Tensor& k_lens, int64_t num_heads,
                         int64_t num_kv_heads, double eps, double scale, int64_t small_rows,
                         int64_t amx_rows, const c10::optional<at::Tensor>& prefix_blocks,
                         int64_t prefix_first) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers + 1,
              "decode_layers takes ", kWeightsPerLayer, " weights per layer and the final norm's");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [T, hidden]");
  const int64_t tokens = x.size(0), head_dim = k_caches[0].size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto prefix_of = [&](const at::Tensor& cache) {  // cascade's shared prefix, [S, Hkv, D]
    const at::Tensor blocks = prefix_first >= 0
                                  ? cache.narrow(0, prefix_first, prefix_blocks->numel())
                                  : cache.index_select(0, *prefix_blocks);
    return blocks.flatten(0, 1);
  };
  c10::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    // input norm, qkv (plain, packed), o (plain, packed), post-attention norm, gate/up
    // (plain, packed), down (plain, packed)
    const at::Tensor* w = &weights[kWeightsPerLayer * l];
    std::vector<at::Tensor> normed = rms_norm(x, residual, w[0], eps);
    residual = residual.has_value() ? normed[1] : x;
    const at::Tensor qkv = linear(normed[0], w[1], w[2], small_rows, amx_rows);
    // q and k heads are adjacent in qkv: rotated in place in one go
    const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
    rotary_embedding(positions, qk, cos, sin);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    store_kv(qk.narrow(1, num_heads, num_kv_heads), v, k_caches[l], v_caches[l], slot_mapping);
    at::Tensor attn = at::empty({tokens, num_heads, head_dim}, x.options());
    const at::Tensor q = qk.narrow(1, 0, num_heads);
    c10::optional<at::Tensor> prefix_out, prefix_lse;
    if (prefix_blocks) {
      prefix_out = at::empty({tokens, num_heads, head_dim}, x.options());
      prefix_lse = attention_over_keys(*prefix_out, q, prefix_of(k_caches[l]),
                                       prefix_of(v_caches[l]), scale, false);
    }
    paged_attention(attn, q, k_caches[l], v_caches[l], block_tables, q_starts, q_lens, k_lens,
                    scale, prefix_out, prefix_lse);
    std::vector<at::Tensor> post = rms_norm(linear(attn.view({tokens, q_size}), w[3], w[4], small_rows, amx_rows),
                                            residual, w[5], eps);
    residual = post[1];
    // gate/up and SiLU-and-mul in one pass where the weight is packed for it (same results)
    const at::Tensor act =
        w[7].dim() == 4 && w[7].scalar_type() == at::kBFloat16
            ? packed_gate_up_silu_bf16(post[0], w[7])
                        : silu_and_mul(linear(post[0], w[6], w[7], small_rows, amx_rows));
    x = linear(act, w[8], w[9], small_rows, amx_rows);
  }
  return rms_norm(x, residual, weights.back(), eps)[0];
}

}  // namespace pagedllm
