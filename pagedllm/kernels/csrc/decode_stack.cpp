// A decode step's whole stack of decoder layers, in one call.
//
// It runs the kernels the model's Python forward runs (models/llama.py, gemma.py, phi3.py,
// qwen3_moe.py, mixtral.py with the CPU ops: rms_norm (Llama's or Gemma's), the linears'
// methods (packed_linear_bf16, gguf_linear, small_linear_bf16, amx_linear_bf16 or oneDNN's
// matmul on the prepacked weight) and their biases, the per-head q/k norms,
// rotary_embedding (on each head's rotary dims), store_kv, paged_attention with the layer's
// window and soft-cap, silu_and_mul, torch's tanh GELU for Gemma's GeGLU, and for a mixture
// of experts torch's softmax and top-k routing, then moe_experts), in the same order on the
// same tensors, so its results are the same bit for bit. Each layer is a StackLayer (ops.h):
// the family is in its data, not in this loop. What it saves is the Python and torch
// dispatch around ~12-20 ops a layer: about 1 ms a step for SmolLM2's 30 layers at one row
// (14.6 -> 13.75 ms).
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
// methods add it (fused only in oneDNN's matmul and torch's fp32 linear).
at::Tensor linear(const at::Tensor& x, const StackLinear& l, int64_t small_rows,
                  int64_t amx_rows) {
  at::Tensor y;
  if (!l.parts.empty())
    y = gguf_parts_linear(x, l);
  else if (x.scalar_type() == at::kFloat)  // fp32 weights: TorchLinearMethod's F.linear
    return at::linear(x, l.weight, l.bias);
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

// What every layer of one step shares.
struct Step {
  const at::Tensor &positions, &slot_mapping, &block_tables, &q_starts, &q_lens, &k_lens;
  int64_t longest_context, num_heads, num_kv_heads;
  double eps;
  int64_t small_rows, amx_rows;
  const c10::optional<at::Tensor>& prefix_blocks;
  int64_t prefix_first;
};

// norm(x) or (norm(x + residual), x + residual) by the layer's kind of norm.
std::vector<at::Tensor> norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                             const at::Tensor& weight, const StackLayer& l, const Step& s) {
  return rms_norm(x, residual, weight, s.eps, l.unit_offset_norms);
}

// Each head's vector [T, heads, D] normed over D (a copy; the q/k norms of Qwen3 and
// Gemma 3, as layers/layernorm.py takes a 3-D input).
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, const StackLayer& l,
                     const Step& s) {
  return norm(x.reshape({-1, x.size(2)}), c10::nullopt, weight, l, s)[0].view(x.sizes());
}

// x [T, heads, D] rotated in place on each head's first rotary_dim dims (0: all of them).
void rotate(at::Tensor x, const StackLayer& l, const Step& s) {
  const bool long_rope = l.long_cos.has_value() && s.longest_context > l.long_after;
  const at::Tensor dims = 0 < l.rotary_dim && l.rotary_dim < x.size(2) ? x.narrow(2, 0, l.rotary_dim) : x;
  rotary_embedding(s.positions, dims, long_rope ? *l.long_cos : l.cos,
                   long_rope ? *l.long_sin : l.sin);
}

// The cascade's shared prefix of a cache, [S, Hkv, D], in the queries' dtype (an int8
// cache's values times their scales, as attention/kv_quant.py's dequantize).
at::Tensor prefix_of(const at::Tensor& cache, const Step& s, at::ScalarType dtype) {
  const at::Tensor blocks = s.prefix_first >= 0
                                ? cache.narrow(0, s.prefix_first, s.prefix_blocks->numel())
                                : cache.index_select(0, *s.prefix_blocks);
  if (cache.scalar_type() != at::kChar) return blocks.flatten(0, 1);
  const int64_t d = cache.size(3) - 4;
  const at::Tensor values = blocks.narrow(3, 0, d).to(at::kFloat);
  const at::Tensor scales = blocks.narrow(3, d, 4).contiguous().view(at::kFloat);
  return (values * scales).to(dtype).flatten(0, 1);
}

// The attention block's output o(attention(...)) for the normed rows h.
at::Tensor attention_block(const at::Tensor& h, const StackLayer& l, const Step& s) {
  const int64_t tokens = h.size(0);
  const int64_t head_dim = l.k_cache.size(3) - (l.k_cache.scalar_type() == at::kChar ? 4 : 0);
  const int64_t q_size = s.num_heads * head_dim, kv_size = s.num_kv_heads * head_dim;
  const at::Tensor qkv = linear(h, l.qkv, s.small_rows, s.amx_rows);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, s.num_kv_heads, head_dim});
  at::Tensor q, k;
  if (l.q_norm.has_value()) {  // normed copies, each rotated in place
    q = head_norm(qkv.narrow(1, 0, q_size).view({tokens, s.num_heads, head_dim}), *l.q_norm, l, s);
    k = head_norm(qkv.narrow(1, q_size, kv_size).view({tokens, s.num_kv_heads, head_dim}),
                  *l.k_norm, l, s);
    rotate(q, l, s);
    rotate(k, l, s);
  } else {  // q and k heads are adjacent in qkv: rotated in place in one go
    const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, s.num_heads + s.num_kv_heads, head_dim});
    rotate(qk, l, s);
    q = qk.narrow(1, 0, s.num_heads);
    k = qk.narrow(1, s.num_heads, s.num_kv_heads);
  }
  store_kv(k, v, l.k_cache, l.v_cache, s.slot_mapping);
  // a window every row's context fits in hides nothing: none is passed (cpu_paged.attention)
  const int64_t window = l.window > 0 && s.longest_context > l.window ? l.window : 0;
  at::Tensor out = at::empty({tokens, s.num_heads, head_dim}, h.options());
  c10::optional<at::Tensor> prefix_out, prefix_lse;
  if (s.prefix_blocks) {
    TORCH_CHECK(window == 0 && l.softcap == 0.0,
                "decode_layers: a cascade's layers take no window or soft-cap");
    prefix_out = at::empty({tokens, s.num_heads, head_dim}, h.options());
    prefix_lse = attention_over_keys(*prefix_out, q, prefix_of(l.k_cache, s, q.scalar_type()),
                                     prefix_of(l.v_cache, s, q.scalar_type()), l.scale, false);
  }
  paged_attention(out, q, l.k_cache, l.v_cache, s.block_tables, s.q_starts, s.q_lens, s.k_lens,
                  l.scale, prefix_out, prefix_lse, window, l.softcap);
  return linear(out.view({tokens, q_size}), l.o, s.small_rows, s.amx_rows);
}

at::Tensor dense_mlp(const at::Tensor& h, const StackMLP& m, const Step& s) {
  const StackLinear& gate_up = m.gate_up;
  at::Tensor act;
  if (m.activation == StackActivation::gelu_tanh) {
    const std::vector<at::Tensor> halves = linear(h, gate_up, s.small_rows, s.amx_rows).chunk(2, -1);
    act = at::gelu(halves[0], "tanh") * halves[1];
  } else if (gate_up.parts.empty() && gate_up.packed.dim() == 4 && !gate_up.bias) {
    act = packed_gate_up_silu_bf16(h, gate_up.packed);  // one pass, the same results
  } else {
    act = silu_and_mul(linear(h, gate_up, s.small_rows, s.amx_rows));
  }
  return linear(act, m.down, s.small_rows, s.amx_rows);
}

at::Tensor moe_block(const at::Tensor& h, const StackMoE& m, const Step& s) {
  const at::Tensor logits = linear(h, m.router, s.small_rows, s.amx_rows);
  auto [weights, ids] = at::topk(at::softmax(logits, -1, at::kFloat), m.top_k, -1);
  if (m.renormalize) weights.div_(weights.sum(-1, true));
  if (!m.weights_in_fp32) weights = weights.to(h.scalar_type());
  at::Tensor out = moe_experts(h.contiguous(), ids, weights.to(at::kFloat), m.gate_up, m.down,
                               s.small_rows);
  if (m.shared.has_value()) {
    TORCH_CHECK(m.shared_gate.has_value(), "decode_layers: a shared expert needs its gate");
    const at::Tensor gate = at::sigmoid(linear(h, *m.shared_gate, s.small_rows, s.amx_rows));
    out = out + gate * dense_mlp(h, *m.shared, s);
  }
  return out;
}

}  // namespace

at::Tensor gguf_parts_linear(const at::Tensor& x, const StackLinear& l) {
  // as layers/quantized.py parts_linear: the kernel takes bf16 rows; fp32 rows (a model in
  // fp32) get its fp32 sums
  const bool fp32 = x.scalar_type() == at::kFloat;
  const at::Tensor xb = fp32 ? x.to(at::kBFloat16) : x;
  if (l.parts.size() == 1)
    return gguf_linear(xb, l.parts[0], l.part_types[0], l.part_rows[0], c10::nullopt, fp32);
  int64_t n = 0;
  for (int64_t rows : l.part_rows) n += rows;
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  for (size_t i = 0, start = 0; i < l.parts.size(); start += l.part_rows[i++])
    gguf_linear(xb, l.parts[i], l.part_types[i], l.part_rows[i],
                y.narrow(1, start, l.part_rows[i]), fp32);
  return y;
}

at::Tensor decode_layers(at::Tensor x, const at::Tensor& positions,
                         const StackLayers& stack, const at::Tensor& final_norm,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& q_starts, const at::Tensor& q_lens,
                         const at::Tensor& k_lens, int64_t longest_context, int64_t num_heads,
                         int64_t num_kv_heads, double eps, int64_t small_rows, int64_t amx_rows,
                         const c10::optional<at::Tensor>& prefix_blocks, int64_t prefix_first) {
  const std::vector<StackLayer>& layers = stack.layers;
  TORCH_CHECK(!layers.empty(), "decode_layers takes at least one layer");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or fp32 [T, hidden]");
  const Step s{positions, slot_mapping, block_tables, q_starts, q_lens, k_lens,
               longest_context, num_heads, num_kv_heads, eps, small_rows, amx_rows,
               prefix_blocks, prefix_first};
  c10::optional<at::Tensor> residual;
  for (const StackLayer& l : layers) {
    TORCH_CHECK(l.mlp.has_value() != l.moe.has_value(),
                "decode_layers: a layer has a dense MLP or a mixture of experts");
    std::vector<at::Tensor> normed = norm(x, residual, l.input_norm, l, s);
    residual = residual.has_value() ? normed[1] : x;
    const at::Tensor attn = attention_block(normed[0], l, s);
    std::vector<at::Tensor> post =
        l.pre_mlp_norm.has_value()
            ? norm(norm(attn, c10::nullopt, l.post_attn_norm, l, s)[0], residual, *l.pre_mlp_norm, l, s)
            : norm(attn, residual, l.post_attn_norm, l, s);
    residual = post[1];
    x = l.mlp.has_value() ? dense_mlp(post[0], *l.mlp, s) : moe_block(post[0], *l.moe, s);
    if (l.post_mlp_norm.has_value()) x = norm(x, c10::nullopt, *l.post_mlp_norm, l, s)[0];
  }
  return rms_norm(x, residual, final_norm, eps, layers.front().unit_offset_norms)[0];
}

}  // namespace pagedllm
