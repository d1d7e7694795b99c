// A decode step's whole stack of decoder layers, in one call.
//
// It runs the kernels the model's Python forward runs (models/llama.py with the CPU ops:
// rms_norm, the linears' methods (packed_linear_bf16, gguf_linear, small_linear_bf16,
// amx_linear_bf16 or oneDNN's matmul on the prepacked weight) and their biases, the per-head
// q/k norms, rotary_embedding, store_kv, paged_attention, silu_and_mul), in the same order
// on the same tensors, so its results are the same bit for bit. What it saves is the Python
// and torch dispatch around ~12-16 ops a layer: about 1 ms a step for SmolLM2's 30 layers at
// one row (14.6 -> 13.75 ms).
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace pagedllm {
namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x.contiguous(), packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 "");
}

// x w^T (+ bias) by the layer's method (see StackLinear), the bias added as the Python
// methods add it (fused only in oneDNN's matmul).
at::Tensor linear(const at::Tensor& x, const StackLinear& l, int64_t small_rows,
                  int64_t amx_rows) {
  at::Tensor y;
  if (!l.parts.empty())
    y = gguf_parts_linear(x, l);
  else if (l.packed.dim() == 4)
    y = packed_linear_bf16(x, l.packed, false);
  else if (x.size(0) <= small_rows)
    y = small_linear_bf16(x, l.weight);
  else if (x.size(0) <= amx_rows && x.size(1) % 32 == 0 && l.weight.size(0) % 32 == 0)
    y = amx_linear_bf16(x, l.weight);
  else
    return onednn_linear(x, l.packed, l.bias);
  return l.bias.has_value() ? y + *l.bias : y;
}

// Each head's vector [T, heads, D] normed over D (a copy; Qwen3's q/k norms, as
// layers/layernorm.py RMSNorm takes a 3-D input).
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x.reshape({-1, x.size(2)}), c10::nullopt, weight, eps)[0].view(x.sizes());
}

}  // namespace

at::Tensor gguf_parts_linear(const at::Tensor& x, const StackLinear& l) {
  if (l.parts.size() == 1)
    return gguf_linear(x, l.parts[0], l.part_types[0], l.part_rows[0], c10::nullopt, false);
  int64_t n = 0;
  for (int64_t rows : l.part_rows) n += rows;
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  for (size_t i = 0, start = 0; i < l.parts.size(); start += l.part_rows[i++])
    gguf_linear(x, l.parts[i], l.part_types[i], l.part_rows[i],
                y.narrow(1, start, l.part_rows[i]), false);
  return y;
}

at::Tensor decode_layers(at::Tensor x, const at::Tensor& positions,
                         const std::vector<StackLayer>& layers, const at::Tensor& final_norm,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& q_starts, const at::Tensor& q_lens,
                         const at::Tensor& k_lens, int64_t num_heads, int64_t num_kv_heads,
                         double eps, double scale, int64_t small_rows, int64_t amx_rows,
                         const c10::optional<at::Tensor>& prefix_blocks, int64_t prefix_first) {
  TORCH_CHECK(!layers.empty(), "decode_layers takes at least one layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [T, hidden]");
  const int64_t tokens = x.size(0), head_dim = layers[0].k_cache.size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto prefix_of = [&](const at::Tensor& cache) {  // cascade's shared prefix, [S, Hkv, D]
    const at::Tensor blocks = prefix_first >= 0
                                  ? cache.narrow(0, prefix_first, prefix_blocks->numel())
                                  : cache.index_select(0, *prefix_blocks);
    return blocks.flatten(0, 1);
  };
  c10::optional<at::Tensor> residual;
  for (const StackLayer& layer : layers) {
    std::vector<at::Tensor> normed = rms_norm(x, residual, layer.input_norm, eps);
    residual = residual.has_value() ? normed[1] : x;
    const at::Tensor qkv = linear(normed[0], layer.qkv, small_rows, amx_rows);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor q, k;
    if (layer.q_norm.has_value()) {  // normed copies, each rotated in place
      q = head_norm(qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim}), *layer.q_norm, eps);
      k = head_norm(qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim}),
                    *layer.k_norm, eps);
      rotary_embedding(positions, q, cos, sin);
      rotary_embedding(positions, k, cos, sin);
    } else {  // q and k heads are adjacent in qkv: rotated in place in one go
      const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
      rotary_embedding(positions, qk, cos, sin);
      q = qk.narrow(1, 0, num_heads);
      k = qk.narrow(1, num_heads, num_kv_heads);
    }
    store_kv(k, v, layer.k_cache, layer.v_cache, slot_mapping);
    at::Tensor attn = at::empty({tokens, num_heads, head_dim}, x.options());
    c10::optional<at::Tensor> prefix_out, prefix_lse;
    if (prefix_blocks) {
      prefix_out = at::empty({tokens, num_heads, head_dim}, x.options());
      prefix_lse = attention_over_keys(*prefix_out, q, prefix_of(layer.k_cache),
                                       prefix_of(layer.v_cache), scale, false);
    }
    paged_attention(attn, q, layer.k_cache, layer.v_cache, block_tables, q_starts, q_lens,
                    k_lens, scale, prefix_out, prefix_lse);
    std::vector<at::Tensor> post = rms_norm(linear(attn.view({tokens, q_size}), layer.o, small_rows, amx_rows),
                                            residual, layer.post_norm, eps);
    residual = post[1];
    // gate/up and SiLU-and-mul in one pass where the weight is packed for it (same results)
    const StackLinear& gate_up = layer.gate_up;
    const at::Tensor act = gate_up.parts.empty() && gate_up.packed.dim() == 4 && !gate_up.bias
                               ? packed_gate_up_silu_bf16(post[0], gate_up.packed)
                               : silu_and_mul(linear(post[0], gate_up, small_rows, amx_rows));
    x = linear(act, layer.down, small_rows, amx_rows);
  }
  return rms_norm(x, residual, final_norm, eps)[0];
}

}  // namespace pagedllm
