// The C++ CPU kernels of pagedllm, one extension (pagedllm/kernels/build.py builds it; kernels/ops.py wraps each op).
#pragma once
#include <torch/extension.h>

namespace pagedllm {

// out[rows' new tokens] = causal attention of q over K/V read in place from the paged cache;
// with prefix_out/prefix_lse (attention over a shared prefix that the tables leave out),
// merged with that by log-sum-exp (cascade attention). window > 0: a query at position p
// sees keys p - window + 1 .. p only (table entries of blocks wholly before its row's first
// query's window are not read: they may be -1); softcap > 0: scores s -> softcap *
// tanh(s / softcap) before the softmax.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& k_lens,
                     double scale, const c10::optional<at::Tensor>& prefix_out,
                     const c10::optional<at::Tensor>& prefix_lse, int64_t window = 0,
                     double softcap = 0.0);
// How paged_attention scores bf16 keys here: "avx512_bf16" (dot products), "avx512"
// (widened to fp32) or "scalar".
std::string paged_attention_scores();
// Tests: true scores bf16 keys by dot products where the CPU has them (the default but on
// AMX CPUs, whose VDPBF16PS is slow), false widens them.
void allow_dot_scores(bool allowed);
// out[prompts' tokens] = causal attention of each prompt (q/k/v[starts[i]:][:lens[i]]) over
// its own tokens, bf16, on AMX tiles (prompt_attention.cpp) where amx_available() (amx.h),
// else on AVX512-BF16 dot products; only where prompt_attention_isa() is not empty.
// window / softcap as paged_attention's (0: none).
void prompt_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& starts, const at::Tensor& lens,
                      double scale, int64_t window = 0, double softcap = 0.0);
// out = attention of the queries q [T, H, D] over the keys k/v [S, Hkv, D]: causal, the
// queries are the last T of the S positions (a chunk over its cached prefix); otherwise
// every query sees every key (a shared prefix that precedes them all). Returns each query's
// log-sum-exp of its scores [T, H] (cascade attention merges by it). Same kernel and
// conditions as prompt_attention.
// window / softcap (causal only for a window) as paged_attention's.
at::Tensor attention_over_keys(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, double scale, bool causal,
                               int64_t window = 0, double softcap = 0.0);
// What those two run on here: "amx", "avx512_bf16", or "" (not built: no AVX512-BF16).
std::string prompt_attention_isa();
// Tests: false makes them take AVX512-BF16 dot products even where AMX runs.
void allow_amx_attention(bool allowed);
// Each new token's K and V into its cache slot (block_id * block_size + offset; -1: skip).
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);

// y = x w^T for bf16 x [M, K] with few rows and a contiguous bf16 w [N, K]; the weight is
// streamed once (AVX512-BF16 dot products). Only built where the CPU has AVX512-BF16.
at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& w);
bool has_small_linear_bf16();
// The same for 1-32 rows on AMX tiles (amx_linear.cpp), reading the plain weight; K and N
// multiples of 32. Only where amx_available().
at::Tensor amx_linear_bf16(const at::Tensor& x, const at::Tensor& w);

// y = x w^T for bf16 x [M, K] at any M, from the weight packed once by
// pack_linear_weight_bf16 ([N, K] -> [N/16, K/2, 16, 2]; N a multiple of 16, K even) for
// AVX512-BF16 dot products (packed_linear.cpp). Only built where the CPU has AVX512-BF16.
at::Tensor pack_linear_weight_bf16(const at::Tensor& w);
// fp32_out: the fp32 sums as they are (logits), not rounded to bf16.
// Where amx_available() it runs on AMX tiles from the same packing (another order of the
// sums: a process takes one path for every call).
at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed, bool fp32_out = false);
bool has_packed_linear_bf16();
// Whether it runs on AMX tiles for inputs of k features (AMX here, k a multiple of 32).
bool packed_linear_uses_amx(int64_t k);
// Tests: false makes packed_linear_bf16 take the dot products even where AMX runs.
void allow_amx_linear(bool allowed);
// silu(x gate^T) * (x up^T) from a gate/up projection packed the same way ([gate; up] rows),
// with the results of packed_linear_bf16 followed by silu_and_mul, bit for bit.
at::Tensor packed_gate_up_silu_bf16(const at::Tensor& x, const at::Tensor& packed);

// y = x w^T for bf16 x [M, K] (row stride free) from a GGUF weight [n, K] of ggml type qtype
// (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) kept quantized (gguf_linear.cpp): w's exact values,
// from layers/gguf_packing.py pack_gguf's uint8 layout. out: an [M, >= n] view (unit column
// stride) whose first n columns are written, bf16, or fp32 with fp32_out (the unrounded
// sums); returns those n columns. AVX512-BF16, else AVX2 + FMA + F16C.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& out, bool fp32_out);
// The GGUF bytes of a weight [n, k] (uint8 [n, bytes per row], as the file holds them) in
// gguf_linear's layout (gguf_pack.cpp): a flat uint8 tensor of gguf_packed_nbytes bytes.
at::Tensor gguf_pack(const at::Tensor& raw, int64_t qtype, int64_t n, int64_t k);
// Bytes of pack_gguf's layout for a weight [n, k] of type qtype.
int64_t gguf_packed_nbytes(int64_t qtype, int64_t n, int64_t k);
// The exact float32 weights of the given output rows [len(rows), k], read from the packed
// form (gguf.quants.dequantize's values bit for bit).
at::Tensor gguf_dequantize_rows(const at::Tensor& packed, int64_t qtype, int64_t n, int64_t k,
                                const at::Tensor& rows);
// What gguf_linear runs on: "amx" (AMX-INT8 tiles, a few rows on AVX512-VNNI: the AVX2
// path's sums), "avx512_bf16", "avx2" or "" (none built).
std::string gguf_linear_isa();
// Tests: "amx", "avx512_bf16" or "avx2" make gguf_linear take that path from now on where the
// build and CPU have it (else an error); "": the best one.
void force_gguf_linear_isa(const std::string& isa);

// Fused elementwise ops (elementwise.cpp), each equal to the torch code it replaces.
// What they run on: "avx512" (16 lanes), "avx2" (8 lanes, with FMA and F16C) or "scalar".
std::string elementwise_isa();
// rms_norm: [norm(x)] or, with a residual, [norm(x + residual), x + residual]; unit_offset:
// Gemma's norm, (x * rsqrt(mean(x^2) + eps)) * (1 + weight) in fp32 rounded once, where
// Llama's rounds the normed x before scaling it by the weight.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps, bool unit_offset = false);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_embedding(const at::Tensor& positions, at::Tensor x, const at::Tensor& cos,
                      const at::Tensor& sin);
at::Tensor argmax_rows(const at::Tensor& x);
// logits[rows[i], t] = -inf where bit t of grammar mask i (int32 words, little-endian) is 0.
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& masks, const at::Tensor& rows);

// A linear layer of the decode stack: x w^T (+ bias) by the method the layer's Python side
// computes with (layers/linear_methods.py, layers/quantized.py). bf16: the plain weight and
// its packing, pagedllm's (4-D: every row count) or oneDNN's (small_linear_bf16 up to
// small_rows rows, amx_linear_bf16 up to amx_rows, oneDNN beyond); or the weight again where
// it has none. fp32: the weight (torch's linear). GGUF kept quantized: one packed part per
// run of output rows of one ggml type (gguf_linear), each computing its columns of the
// output, for bf16 or fp32 rows.
struct StackLinear {
  at::Tensor weight, packed;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> part_types, part_rows;
  c10::optional<at::Tensor> bias;
};

// x w^T of a StackLinear's GGUF parts (decode_stack.cpp): one gguf_linear call, or one per
// part into its columns of the output (as layers/quantized.py parts_linear).
at::Tensor gguf_parts_linear(const at::Tensor& x, const StackLinear& l);

// What a dense MLP's gate goes through: SiLU (Llama's SiluAndMul: silu_and_mul, or fused
// into a packed gate/up projection) or GELU's tanh approximation (Gemma's GeGLU: torch's
// gelu then mul, as layers/activation.py GeluAndMul).
enum class StackActivation { silu, gelu_tanh };

// A dense gated MLP of the decode stack: down(act(gate) * up), gate_up holding [gate; up].
struct StackMLP {
  StackLinear gate_up, down;
  StackActivation activation = StackActivation::silu;
};

// A mixture-of-experts block of the decode stack (models/qwen3_moe.py SparseMoeBlock over
// layers/moe.py FusedMoE): the router's logits, their fp32 softmax, each token's top_k
// experts (renormalised to sum to 1 with renormalize), the routing weights rounded to the
// activations' dtype unless weights_in_fp32 (Mixtral), moe_experts over the experts'
// projections; plus, where shared is set, a dense MLP every token passes through, scaled by
// sigmoid(shared_gate(x)) (Qwen2-MoE).
struct StackMoE {
  StackLinear router;
  std::vector<StackLinear> gate_up, down;
  int64_t top_k = 1;
  bool renormalize = false, weights_in_fp32 = false;
  c10::optional<StackMLP> shared;
  c10::optional<StackLinear> shared_gate;
};

// A decoder layer of the decode stack, as data: whatever the family, the layer is
//   h, residual = input_norm(x, residual)
//   a = o(attention(rotary(qkv(h)))), with q/k norms where set
//   Llama:            h, residual = post_attn_norm(a, residual)
//   Gemma (pre_mlp):  h, residual = pre_mlp_norm(post_attn_norm(a), residual)
//   x = mlp(h) or moe(h), then post_mlp_norm(x) where set.
// unit_offset_norms: every norm of the layer scales by 1 + weight (Gemma). The attention:
// its scale, window (0: none; a step where every row's context fits in it takes none, as
// attention/cpu_paged.py) and score soft-cap (0: none). Rotary: each head's first
// rotary_dim dims (0: all) rotated by cos/sin [max_pos, rotary_dim] (fp32), or by long_cos/long_sin
// where the step's rows are longer than long_after (LongRoPE; the caller makes sure they
// all are or none is).
struct StackLayer {
  at::Tensor input_norm, post_attn_norm;
  c10::optional<at::Tensor> pre_mlp_norm, post_mlp_norm, q_norm, k_norm;
  bool unit_offset_norms = false;
  StackLinear qkv, o;
  double scale = 1.0, softcap = 0.0;
  int64_t window = 0;
  int64_t rotary_dim = 0, long_after = 0;
  at::Tensor cos, sin;
  c10::optional<at::Tensor> long_cos, long_sin;
  c10::optional<StackMLP> mlp;
  c10::optional<StackMoE> moe;
  at::Tensor k_cache, v_cache;
};

// A model's layer descriptions as decode_layers takes them, copied from Python once: a
// Python list given to each call is converted, every description copied, each call, which
// for Qwen3-30B-A3B is 12,288 experts' linears a step (3% of a decode step's samples).
struct StackLayers {
  std::vector<StackLayer> layers;
};

// A decode step's decoder layers for bf16 or fp32 rows (decode_stack.cpp): the embeddings x
// [T, hidden] in, the final norm's output out (final_norm is of the layers' kind); the same
// kernels as the model's per-op forward on the same tensors, so the same results bit for
// bit. The attention metadata is the paged_attention kernel's, for the step's rows;
// longest_context is the step's longest row in tokens (windows and LongRoPE choose by it).
// With prefix_blocks, a prefix every row shares that the tables leave out: cascade
// attention, its part by attention_over_keys (as attention/cpu_paged.py) on a view of each
// cache from block prefix_first when the blocks are adjacent (prefix_first >= 0, as
// cpu_paged.SharedPrefix.cache_index found), else on a copy of them; only for layers that
// take no window or soft-cap in this step.
at::Tensor decode_layers(at::Tensor x, const at::Tensor& positions,
                         const StackLayers& layers, const at::Tensor& final_norm,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& q_starts, const at::Tensor& q_lens,
                         const at::Tensor& k_lens, int64_t longest_context, int64_t num_heads,
                         int64_t num_kv_heads, double eps, int64_t small_rows, int64_t amx_rows,
                         const c10::optional<at::Tensor>& prefix_blocks, int64_t prefix_first);

// A mixture-of-experts block's routed experts (moe.cpp) for bf16 rows x, or fp32 ones with
// GGUF experts: each token's top-k experts (ids [T, k]) weighted by weights (fp32 [T, k]),
// each chosen expert's MLP
// down(silu(gate_up(x))) run once over the tokens that chose it (its projections as
// StackLinear: GGUF parts, else the bf16 weight by small_linear_bf16 up to small_rows rows,
// torch's linear beyond); the same results as layers/moe.py forward_grouped bit for bit.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const std::vector<StackLinear>& gate_up,
                       const std::vector<StackLinear>& down, int64_t small_rows);
}  // namespace pagedllm
