// A decode step's whole stack of decoder layers for a few rows, in one call.
//
// It runs the kernels the model's Python forward runs (models/llama.py with the CPU ops:
// rms_norm, small_linear_bf16, rotary_embedding, store_kv, paged_attention, silu_and_mul),
// in the same order on the same tensors, so its results are the same bit for bit. What it
// saves is the Python and torch dispatch around ~12 ops a layer: about 1 ms of a 14 ms
// single-stream step (measured), which is a tenth of the time left over the bandwidth bound.
#include "ops.h"

namespace pagedllm {

at::Tensor decode_layers(at::Tensor x, const at::Tensor& positions,
                         const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& k_caches,
                         const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& q_starts,
                         const at::Tensor& q_lens, const at::Tensor& k_lens, int64_t num_heads,
                         int64_t num_kv_heads, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers + 1,
              "decode_layers takes ", kWeightsPerLayer, " weights per layer and the final norm's");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [T, hidden]");
  const int64_t tokens = x.size(0), head_dim = k_caches[0].size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  c10::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    // input norm, qkv projection, output projection, post-attention norm, gate/up, down
    const at::Tensor* w = &weights[kWeightsPerLayer * l];
    std::vector<at::Tensor> normed = rms_norm(x, residual, w[0], eps);
    residual = residual.has_value() ? normed[1] : x;
    const at::Tensor qkv = small_linear_bf16(normed[0], w[1]);
    // q and k heads are adjacent in qkv: rotated in place in one go
    const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
    rotary_embedding(positions, qk, cos, sin);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    store_kv(qk.narrow(1, num_heads, num_kv_heads), v, k_caches[l], v_caches[l], slot_mapping);
    at::Tensor attn = at::empty({tokens, num_heads, head_dim}, x.options());
    paged_attention(attn, qk.narrow(1, 0, num_heads), k_caches[l], v_caches[l], block_tables,
                    q_starts, q_lens, k_lens, scale, c10::nullopt, c10::nullopt);
    std::vector<at::Tensor> post = rms_norm(small_linear_bf16(attn.view({tokens, q_size}), w[2]),
                                            residual, w[3], eps);
    residual = post[1];
    x = small_linear_bf16(silu_and_mul(small_linear_bf16(post[0], w[4])), w[5]);
  }
  return rms_norm(x, residual, weights.back(), eps)[0];
}

}  // namespace pagedllm
