// Causal attention of prompts over their own tokens, on the CPU's AMX tiles (bf16), or
// where there are none (AMD Zen 4 and 5), on AVX512-BF16 dot products in the same layout.
//
// Torch's flash attention for CPU reaches 270-330 GFLOP/s here on SmolLM2's shapes (9 query
// heads over 3 KV heads of 64), against a matmul peak near 2,300: in a 2048-token prefill
// step it takes a quarter of the time, and for long prompts most of it (attention grows
// with the square of the length, the linear layers with the length).
//
// The same flash-attention loop, for 16 queries at a time over chunks of 32 keys, on
// transposes, so that the 16 queries lie across a vector's lanes:
//   S^T = K Q^T        2 tiles of 16 keys x 16 queries, AMX dot products over D;
//   online softmax     AVX-512, lane-wise (no reductions across lanes): scale, causal mask,
//                      running max and sum in fp32, P^T rounded to bf16;
//   O^T += V^T P^T     4 accumulator tiles per 64 dims. At head_dim 64 they stay in the
//                      tiles for the whole loop: the running maximum is raised only when a
//                      chunk's scores outgrow it by more than kMaxSlack, and only then is O
//                      rescaled. At 128 and 256 (8 tiles cannot hold 8 or 16 accumulators
//                      besides S^T and the operands), O^T lives in Scratch::acc and passes
//                      through the 4 tiles 64 dims at a time, once per chunk.
// K and V^T of every (prompt, KV head) are copied once per call into 32-key chunks (a first
// parallel pass), then read by every query head of the group and every query block.
// On SmolLM2's shapes: 1.6x torch's flash attention at 64-256 tokens, 1.8x at 2048 (431
// and 874 GFLOP/s, 2 threads).
//
// Without AMX (a CPU without it, or a kernel that refuses it to the process), each tile
// product is 256 AVX512-BF16 dot products: for each pair of the right operand's rows, one
// vector of it against each row of the left operand's pair broadcast to every lane. The
// 16 x 16 fp32 result stays in registers for the whole sum (S^T, 16 keys at a time), or is
// loaded and stored once per 32-key chunk (O^T, from Scratch::acc). Torch's flash attention
// on such a CPU computes in fp32 through MKL's sgemm: about 100 GFLOP/s on 2 Zen 5 cores,
// a quarter of a 2048-token prefill step.
//
// Every loop over D is a template on it: head_dim 64, 128 and 256 (SmolLM2; Qwen3 and
// Llama 3; Gemma), the same code at each. On Zen 5 at Qwen3-0.6B's shapes (16 query heads
// over 8 KV heads of 128), 512 and 2,048 tokens: 2.6-3.9x torch's flash attention (163
// GFLOP/s on one core, up to 321 on two).
//
// Work items are (prompt, query head, 16-query block), largest first, handed out one at a
// time. A build without AVX512-BF16 has no kernel here: prompt_attention_isa() says so and
// the caller takes torch's.
#include "amx.h"
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>


namespace {

// Tests turn AMX off to run the AVX512-BF16 path on CPUs that have both.
std::atomic<bool> amx_allowed{true};

#if defined(PAGEDLLM_BF16_DOT)

constexpr int64_t kBlock = 32;  // keys per chunk
using BF16 = c10::BFloat16;

using pagedllm::transpose16x16;

struct Segments {
  const BF16 *q, *k, *v;
  BF16* out;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h;
  int64_t out_stride_t, out_stride_h;
  int64_t heads, kv_heads, dim;  // dim: head_dim, 64, 128 or 256
  // Segment i: queries q[q_starts[i]:][:q_lens[i]] over keys k/v[k_starts[i]:][:k_lens[i]];
  // causal: the queries are the last q_lens[i] of the k_lens[i] positions (each sees the
  // keys up to its own); otherwise every query sees every key.
  const int64_t *q_starts, *q_lens, *k_starts, *k_lens;
  bool causal;
  float scale;
  int64_t window = 0;   // causal only: > 0, query at position p sees keys p - window + 1 .. p
  float softcap = 0.f;  // > 0: scaled scores s -> softcap * tanh(s / softcap)
  float* lse = nullptr;  // [T, H]: each query's log-sum-exp of its scores, if wanted
  int64_t lse_stride_t = 0;
  std::vector<int64_t> chunk_offset;  // each segment's first 32-key chunk in the rearranged K/V
};

// One 32-key chunk of one (prompt, KV head), rearranged for the tiles:
//   keys: [32 keys][D]   the left operand of S^T = K Q^T (a tile row is a key)
//   vt:   [D][32 keys]   the left operand of O^T = V^T P^T (a tile row is a dimension)
// Keys past the prompt's end are zeros (their scores are masked, and 0 * V must be 0).
// Working on transposes puts the 16 queries of a tile across a vector's lanes: the softmax's
// row maxima and sums are lane-wise (no reduction across lanes), and so is rescaling O.
template <int64_t D>
constexpr int64_t kChunkElems = 2 * kBlock * D;

template <int64_t D>
void rearrange_chunk(const Segments& p, int64_t prompt, int64_t kv_head, int64_t chunk,
                     BF16* dst) {
  const int64_t len = p.k_lens[prompt], k0 = chunk * kBlock;
  const BF16* k = p.k + p.k_starts[prompt] * p.k_stride_t + kv_head * p.k_stride_h;
  const BF16* v = p.v + p.k_starts[prompt] * p.v_stride_t + kv_head * p.v_stride_h;
  // V as 32-bit units (pairs of dims), transposed 16 x 16 at a time: vu[unit][key half]
  // holds 16 keys' (V[key][2 unit], V[key][2 unit + 1]).
  __m512i vu[D / 2][2];
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t ub = 0; ub < D / 32; ++ub) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t key = k0 + half * 16 + i;
        r[i] = key < len ? _mm512_loadu_si512(v + key * p.v_stride_t + ub * 32)
                         : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int64_t u = 0; u < 16; ++u) vu[ub * 16 + u][half] = r[u];
    }
  // Row d of V^T: the low (even d) or high (odd d) halves of unit d / 2, keys 0-15 then 16-31.
  const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
                                        34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
                                        4, 2, 0);
  const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
  BF16* vt = dst + kBlock * D;
  for (int64_t u = 0; u < D / 2; ++u) {
    _mm512_storeu_si512(vt + (2 * u) * kBlock, _mm512_permutex2var_epi16(vu[u][0], even, vu[u][1]));
    _mm512_storeu_si512(vt + (2 * u + 1) * kBlock,
                        _mm512_permutex2var_epi16(vu[u][0], odd, vu[u][1]));
  }
  for (int64_t j = 0; j < kBlock; ++j) {
    const int64_t key = k0 + j;
    if (key < len)
      std::copy_n(k + key * p.k_stride_t, D, dst + j * D);
    else
      std::fill_n(dst + j * D, D, BF16(0.f));
  }
}

constexpr int64_t kQueries = 16;  // queries per work item: one tile's lanes
// The running maximum of a query is raised (and O and the sum rescaled) only when a chunk's
// scores exceed it by more than this: until then e^(score - max) <= e^8 ~ 3000, as exact in
// fp32 and bf16 as below 1 (softmax does not depend on the shift). Rescaling means moving
// O out of the tiles and back.
constexpr float kMaxSlack = 8.f;

template <int64_t D>
struct Scratch {
  // Q^T in the tiles' pair order: [D / 32][16 pairs of dims][16 queries] (32-bit units
  // holding two bf16); P^T likewise: [16 pairs of keys][16 queries].
  alignas(64) uint32_t qt[D * kQueries / 2];
  alignas(64) uint32_t pt[kBlock * kQueries / 2];
  alignas(64) float scores[kBlock * kQueries];  // S^T [32 keys][16 queries]
  alignas(64) float acc[D * kQueries];          // O^T [D][16 queries], when out of the tiles
};

// Two fp32 vectors of probabilities rounded to bf16 (to nearest even) and interleaved lane
// by lane: lane i holds (a[i], b[i]), as the tiles take pairs.
inline __m512i pair_bf16(__m512 a, __m512 b) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 values, then b's
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, both);
}

// e^x for the softmax's x <= kMaxSlack (lanes at -inf come out NaN and are masked away
// after): as pagedllm::exp16 but to degree 5 (relative error < 3e-6, far below the bf16
// rounding of P) and without clamping.
inline __m512 exp_scores(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  y = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), y);
  __m512 p = _mm512_set1_ps(1.f / 120);
  for (float c : {1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

#if defined(PAGEDLLM_AMX)
// 64 dims of O^T [dims][16 queries] in tiles 0-3: out to memory, or back in.
inline void store_acc(float* acc) {
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 16 * kQueries, 64);
  _tile_stored(2, acc + 32 * kQueries, 64);
  _tile_stored(3, acc + 48 * kQueries, 64);
}
inline void load_acc(const float* acc) {
  _tile_loadd(0, acc, 64);
  _tile_loadd(1, acc + 16 * kQueries, 64);
  _tile_loadd(2, acc + 32 * kQueries, 64);
  _tile_loadd(3, acc + 48 * kQueries, 64);
}

// S^T [32 keys][16 queries] = K Q^T on tiles 4 and 5 (16 keys each), into s.scores.
template <int64_t D>
inline void scores_on_tiles(const BF16* keys, Scratch<D>& s) {
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t d = 0; d < D / 32; ++d) {  // over 32 dims at a time
    _tile_loadd(7, s.qt + d * 256, 64);
    _tile_loadd(6, keys + d * 32, D * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, keys + 16 * D + d * 32, D * 2);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, s.scores, 64);
  _tile_stored(5, s.scores + 16 * kQueries, 64);
}

// 64 dims of O^T in tiles 0-3 += their V^T (vt: the first of the 64 rows) P^T (in tile 7).
inline void accumulate_on_tiles(const BF16* vt) {
  _tile_loadd(6, vt, 64);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(6, vt + 16 * kBlock, 64);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(6, vt + 32 * kBlock, 64);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(6, vt + 48 * kBlock, 64);
  _tile_dpbf16ps(3, 6, 7);
}
#endif

// The tile products without tiles (AVX512-BF16). A 32-bit pair of bf16 of the left operand,
// for a broadcast.
inline __m512bh pair_at(const BF16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

// S^T [32 keys][16 queries] = K Q^T, into s.scores (keys as in the chunk, Q^T as s.qt).
template <int64_t D>
inline void scores_by_dots(const BF16* keys, Scratch<D>& s) {
  for (int64_t half = 0; half < 2; ++half) {
    __m512 acc[16];
    for (int64_t r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    const BF16* k = keys + half * 16 * D;
    for (int64_t u = 0; u < D / 2; ++u) {  // a pair of dims: row u of Q^T's pair order
      const __m512bh qv = (__m512bh)_mm512_load_si512(s.qt + u * 16);
      for (int64_t r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], pair_at(k + r * D + 2 * u), qv);
    }
    for (int64_t r = 0; r < 16; ++r) _mm512_store_ps(s.scores + (half * 16 + r) * kQueries, acc[r]);
  }
}

// O^T [D][16 queries] in s.acc += V^T P^T (V^T as in the chunk, P^T as s.pt).
template <int64_t D>
inline void accumulate_by_dots(const BF16* vt, Scratch<D>& s) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[16];
    for (int64_t r = 0; r < 16; ++r) acc[r] = _mm512_load_ps(s.acc + (d0 + r) * kQueries);
    for (int64_t u = 0; u < kBlock / 2; ++u) {  // a pair of keys
      const __m512bh pv = (__m512bh)_mm512_load_si512(s.pt + u * 16);
      for (int64_t r = 0; r < 16; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], pair_at(vt + (d0 + r) * kBlock + 2 * u), pv);
    }
    for (int64_t r = 0; r < 16; ++r) _mm512_store_ps(s.acc + (d0 + r) * kQueries, acc[r]);
  }
}

// Amx: the products run on tiles, else on AVX512-BF16. O^T stays in tiles 0-3 for the whole
// loop where it fits them (AMX, D = 64); else it lives in s.acc, and AMX moves it through
// tiles 0-3 64 dims at a time (8 tiles cannot hold D / 16 accumulators besides S^T's two
// and the two operands).
template <bool Amx, int64_t D>
void attend_block(const Segments& p, const BF16* rearranged, int64_t prompt, int64_t head,
                  int64_t block, Scratch<D>& s) {
  [[maybe_unused]] constexpr bool in_tiles = Amx && D == 64;
  const int64_t len = p.q_lens[prompt], keys_len = p.k_lens[prompt], q0 = block * kQueries;
  const int64_t offset = keys_len - len;  // causal: query i sits at position offset + i
  const int64_t kv_head = head / (p.heads / p.kv_heads);
  const BF16* q = p.q + p.q_starts[prompt] * p.q_stride_t + head * p.q_stride_h;
  for (int64_t d = 0; d < D / 32; ++d) {  // Q^T in pair order; queries past the end: 0
    __m512i rows[16];
    for (int64_t i = 0; i < kQueries; ++i)
      rows[i] = q0 + i < len ? _mm512_loadu_si512(q + (q0 + i) * p.q_stride_t + d * 32)
                             : _mm512_setzero_si512();
    transpose16x16(rows);
    for (int64_t pair = 0; pair < 16; ++pair) _mm512_store_si512(s.qt + d * 256 + pair * 16, rows[pair]);
  }
  const __m512 scale = _mm512_set1_ps(p.scale), minus_inf = _mm512_set1_ps(-INFINITY);
  const int64_t window = p.causal ? p.window : 0;
  // With a window, a lane may see no key of a chunk (its window starts in a later one): its
  // maximum starts finite so that rescaling it never computes -inf - -inf.
  __m512 max = window > 0 ? _mm512_set1_ps(-FLT_MAX) : minus_inf, sum = _mm512_setzero_ps();
#if defined(PAGEDLLM_AMX)
  if constexpr (in_tiles) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
#endif
  if constexpr (!in_tiles) std::fill_n(s.acc, D * kQueries, 0.f);
  const int64_t last_key = p.causal ? offset + std::min(q0 + kQueries, len) - 1 : keys_len - 1;
  // The first chunk holding a key of the block's first query's window: the chunks before
  // it are skipped.
  const int64_t first_chunk = window > 0 ? std::max<int64_t>(0, offset + q0 - window + 1) / kBlock : 0;
  for (int64_t c = first_chunk; c * kBlock <= last_key; ++c) {
    const BF16* keys = rearranged +
                       ((p.chunk_offset[prompt] + c) * p.kv_heads + kv_head) * kChunkElems<D>;
    const BF16* vt = keys + kBlock * D;
#if defined(PAGEDLLM_AMX)
    if constexpr (Amx) scores_on_tiles(keys, s);
#endif
    if constexpr (!Amx) scores_by_dots(keys, s);
    // Key k0 + j exists if below keys_len; causal, it is visible to query q0 + i when
    // offset + q0 + i >= k0 + j.
    const int64_t k0 = c * kBlock;
    auto visible = [&](int64_t j) -> __mmask16 {
      if (k0 + j >= keys_len) return 0;
      const int64_t shift = p.causal ? k0 + j - offset - q0 : 0;
      const __mmask16 seen = shift <= 0 ? 0xFFFF : shift >= 16 ? 0 : static_cast<__mmask16>(0xFFFF << shift);
      if (window <= 0) return seen;
      // and within the window of queries i < shift + window
      const int64_t upto = shift + window;
      return seen & (upto >= 16 ? 0xFFFF : upto <= 0 ? 0 : static_cast<__mmask16>((1u << upto) - 1));
    };
    __m512 x[kBlock];
    __m512 chunk_max = minus_inf;
    if (p.softcap > 0.f) {
      for (int64_t j = 0; j < kBlock; ++j) {
        const __m512 capped = pagedllm::softcap16(
            _mm512_mul_ps(_mm512_loadu_ps(s.scores + j * kQueries), scale), p.softcap);
        x[j] = _mm512_mask_mov_ps(minus_inf, visible(j), capped);
        chunk_max = _mm512_max_ps(chunk_max, x[j]);
      }
    } else {
      for (int64_t j = 0; j < kBlock; ++j) {
        x[j] = _mm512_mask_mul_ps(minus_inf, visible(j), _mm512_loadu_ps(s.scores + j * kQueries),
                                  scale);
        chunk_max = _mm512_max_ps(chunk_max, x[j]);
      }
    }
    // Raise the maxima (all lanes at once) when one lane's scores outgrow its own.
    if (_mm512_cmp_ps_mask(chunk_max, _mm512_add_ps(max, _mm512_set1_ps(kMaxSlack)),
                           _CMP_GT_OQ)) {
      const __m512 new_max = _mm512_max_ps(max, chunk_max);
      if (c > first_chunk) {  // O and the sums so far, rescaled by e^(old - new)
        const __m512 alpha = pagedllm::exp16(_mm512_sub_ps(max, new_max));
        sum = _mm512_mul_ps(sum, alpha);
#if defined(PAGEDLLM_AMX)
        if constexpr (in_tiles) store_acc(s.acc);
#endif
        for (int64_t d = 0; d < D; ++d)
          _mm512_store_ps(s.acc + d * kQueries, _mm512_mul_ps(_mm512_load_ps(s.acc + d * kQueries), alpha));
#if defined(PAGEDLLM_AMX)
        if constexpr (in_tiles) load_acc(s.acc);
#endif
      }
      max = new_max;
    }
    for (int64_t j = 0; j < kBlock; j += 2) {  // P^T = e^(S^T - max), pairs of keys
      const __m512 e0 = _mm512_maskz_mov_ps(visible(j), exp_scores(_mm512_sub_ps(x[j], max)));
      const __m512 e1 =
          _mm512_maskz_mov_ps(visible(j + 1), exp_scores(_mm512_sub_ps(x[j + 1], max)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_store_si512(s.pt + (j / 2) * 16, pair_bf16(e0, e1));
    }
#if defined(PAGEDLLM_AMX)
    if constexpr (Amx) {  // O^T[dims][queries] += V^T P^T, 64 dims at a time
      _tile_loadd(7, s.pt, 64);
      for (int64_t d = 0; d < D; d += 64) {
        if constexpr (!in_tiles) load_acc(s.acc + d * kQueries);
        accumulate_on_tiles(vt + d * kBlock);
        if constexpr (!in_tiles) store_acc(s.acc + d * kQueries);
      }
    }
#endif
    if constexpr (!Amx) accumulate_by_dots(vt, s);
  }
#if defined(PAGEDLLM_AMX)
  if constexpr (in_tiles) store_acc(s.acc);
#endif
  // out[query][d] = O^T[d][query] / sum[query], 16 dims at a time
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), sum);
  BF16* out = p.out + p.q_starts[prompt] * p.out_stride_t + head * p.out_stride_h;
  if (p.lse) {  // log(sum e^(score - max)) + max
    alignas(64) float maxima[kQueries], sums[kQueries];
    _mm512_store_ps(maxima, max);
    _mm512_store_ps(sums, sum);
    for (int64_t i = 0; i < kQueries && q0 + i < len; ++i)
      p.lse[(p.q_starts[prompt] + q0 + i) * p.lse_stride_t + head] = maxima[i] + std::log(sums[i]);
  }
  for (int64_t d = 0; d < D; d += 16) {
    __m512i rows[16];
    for (int64_t k = 0; k < 16; ++k)
      rows[k] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(s.acc + (d + k) * kQueries), inv));
    transpose16x16(rows);
    for (int64_t i = 0; i < kQueries && q0 + i < len; ++i)
      pagedllm::store16(out + (q0 + i) * p.out_stride_t + d, _mm512_castsi512_ps(rows[i]));
  }
}

#endif  // PAGEDLLM_BF16_DOT

// Whether the kernels take AMX tiles: the CPU and kernel allow it, and tests have not
// turned it off.
bool use_amx() { return pagedllm::amx_available() && amx_allowed.load(); }

}  // namespace

namespace pagedllm {

std::string prompt_attention_isa() {
#if defined(PAGEDLLM_BF16_DOT)
  return use_amx() ? "amx" : "avx512_bf16";
#else
  return "";
#endif
}

void allow_amx_attention(bool allowed) { amx_allowed.store(allowed); }

namespace {

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v) {
  TORCH_CHECK(!prompt_attention_isa().empty(),
              "the prompt attention kernel is not built here (it needs AVX512-BF16)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "q, out [T, H, D] and k, v [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "the prompt attention kernel takes bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0,
              "k and v must be alike, with q's head_dim, and divide q's heads");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256,
              "the prompt attention kernel takes head_dim 64, 128 or 256");
}

#if defined(PAGEDLLM_BF16_DOT)
struct Item { int64_t segment, head, block, chunks; };  // a work item: 16 queries of one head

template <bool Amx, int64_t D>
void attend_items(const Segments& p, const BF16* rearranged, const std::vector<Item>& items) {
  std::atomic<int64_t> next{0};
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if defined(PAGEDLLM_AMX)
    if constexpr (Amx) pagedllm::configure_tiles();
#endif
    Scratch<D> s;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) <
                    static_cast<int64_t>(items.size());)
      attend_block<Amx, D>(p, rearranged, items[i].segment, items[i].head, items[i].block, s);
#if defined(PAGEDLLM_AMX)
    if constexpr (Amx) _tile_release();
#endif
  });
}

template <int64_t D>
void run_with_dim(Segments& p, int64_t n) {
  p.chunk_offset.assign(n + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    p.chunk_offset[i + 1] = p.chunk_offset[i] + (p.k_lens[i] + kBlock - 1) / kBlock;
  const int64_t total_chunks = p.chunk_offset[n];
  // Every element is written by the first pass: no zeroing (a 1,024-token prefix of 3 KV
  // heads is 0.8 MB per layer).
  std::unique_ptr<BF16[]> rearranged(new BF16[total_chunks * p.kv_heads * kChunkElems<D>]);
  // (segment, chunk) pairs, then every KV head of each: the first pass, in parallel.
  std::vector<std::pair<int64_t, int64_t>> chunk_ids;
  chunk_ids.reserve(total_chunks);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < p.chunk_offset[i + 1] - p.chunk_offset[i]; ++c)
      chunk_ids.emplace_back(i, c);
  at::parallel_for(0, total_chunks * p.kv_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const auto [segment, c] = chunk_ids[j / p.kv_heads];
      const int64_t h = j % p.kv_heads;
      rearrange_chunk<D>(p, segment, h, c,
                         rearranged.get() + ((p.chunk_offset[segment] + c) * p.kv_heads + h) *
                                                 kChunkElems<D>);
    }
  });
  // (segment, head, query block), the most key chunks first.
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b * kQueries < p.q_lens[i]; ++b) {
      const int64_t last = p.causal ? p.k_lens[i] - p.q_lens[i] +
                                          std::min(b * kQueries + kQueries, p.q_lens[i]) - 1
                                    : p.k_lens[i] - 1;
      // (with a window, the chunks before the block's first query's window are skipped)
      const int64_t first = p.causal && p.window > 0
                                ? std::max<int64_t>(0, p.k_lens[i] - p.q_lens[i] + b * kQueries -
                                                           p.window + 1) / kBlock
                                : 0;
      for (int64_t h = 0; h < p.heads; ++h) items.push_back({i, h, b, last / kBlock + 1 - first});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.chunks > b.chunks; });
#if defined(PAGEDLLM_AMX)
  if (use_amx()) return attend_items<true, D>(p, rearranged.get(), items);
#endif
  attend_items<false, D>(p, rearranged.get(), items);
}

// head_dim (one of those check_inputs takes) as a compile-time constant.
void run(Segments& p, int64_t n) {
  if (p.dim == 64) return run_with_dim<64>(p, n);
  if (p.dim == 128) return run_with_dim<128>(p, n);
  run_with_dim<256>(p, n);
}

Segments make_segments(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, float scale, bool causal) {
  Segments p{q.data_ptr<BF16>(), k.data_ptr<BF16>(), v.data_ptr<BF16>(), out.data_ptr<BF16>(),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), q.size(1), k.size(1), q.size(2)};
  p.causal = causal;
  p.scale = scale;
  return p;
}
#endif  // PAGEDLLM_BF16_DOT

}  // namespace

void prompt_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& starts, const at::Tensor& lens,
                      double scale, int64_t window, double softcap) {
  check_inputs(out, q, k, v);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(k.size(0) == q.size(0), "k and v must have q's tokens");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  starts.is_contiguous() && lens.is_contiguous() &&
                  starts.numel() == lens.numel(),
              "starts and lens must be int64 [num_prompts]");
  const int64_t n = starts.numel(), tokens = q.size(0);
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ln[i] > 0 && st[i] >= 0 && st[i] + ln[i] <= tokens, "prompt ", i,
                " lies outside q");
#if defined(PAGEDLLM_BF16_DOT)
  Segments p = make_segments(out, q, k, v, static_cast<float>(scale), true);
  p.window = window;
  p.softcap = static_cast<float>(softcap);
  p.q_starts = p.k_starts = st;
  p.q_lens = p.k_lens = ln;
  run(p, n);
#endif
}

at::Tensor attention_over_keys(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, double scale, bool causal, int64_t window,
                               double softcap) {
  check_inputs(out, q, k, v);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(causal || window == 0, "a window needs causal attention");
  TORCH_CHECK(q.size(0) > 0 && k.size(0) > 0, "no queries or no keys");
  TORCH_CHECK(!causal || q.size(0) <= k.size(0), "causal: the queries are the last of the keys' positions");
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
#if defined(PAGEDLLM_BF16_DOT)
  Segments p = make_segments(out, q, k, v, static_cast<float>(scale), causal);
  p.window = window;
  p.softcap = static_cast<float>(softcap);
  const int64_t zero = 0, queries = q.size(0), keys = k.size(0);
  p.q_starts = p.k_starts = &zero;
  p.q_lens = &queries;
  p.k_lens = &keys;
  p.lse = lse.data_ptr<float>();
  p.lse_stride_t = lse.stride(0);
  run(p, 1);
#endif
  return lse;
}

}  // namespace pagedllm
