// Paged attention for CPU: every query token of every row attends, causally, to its
// sequence's K/V read in place from the paged cache through the row's block table.
//
// A row computes q_len new tokens after k_len - q_len tokens already cached (decode:
// q_len == 1; a prefill chunk over a cached prefix: q_len > 1). The new tokens' K/V must
// already be stored in the cache. Work is split into (row, chunk of query tokens) items, for
// one kv head each or, when there are enough items for every thread, for all of them; the
// query heads sharing a KV head (GQA) read each cached block once.
//
// Keys are attended in segments of kKeySegment positions at fixed offsets of each row (keys
// 0..S-1, S..2S-1, ...): each segment gives a query a partial result, folded into the
// running one in order (fold_segment). The segments are the same whichever way a step's
// work is split, so a query's result is too; what they buy is the split itself: a single
// stream's row is cut between the threads at segment edges, each thread reading keys of
// its own (with SmolLM2's 3 KV heads as items, one of 2 threads sat idle a third of the
// time; vLLM's paged_attention_v2 cuts rows likewise, in partitions of 512 keys, for GPUs).
// A row within one segment gets the plain one-pass softmax's sums exactly.
//
// A window w (> 0) limits the query at position p to the keys p - w + 1 .. p: a row is read
// from the first key its chunk's first query sees, so the blocks wholly before it (which
// the block manager may have freed: table entry -1) are never touched. A soft-cap c (> 0)
// maps each scaled score s to c * tanh(s / c) before the softmax. With neither, the code
// and its results are those without the feature.
//
// An int8 cache (kv_cache_dtype="int8") holds each token's head vector as D int8 values
// followed by the fp32 scale they were divided by (4 bytes: D + 4 a vector; store_kv
// quantizes, attention/kv_quant.py has the rule): a key's score is its scale times the dot
// product of its values with the query, a value's weight in the output the probability
// times its scale. It reads half a bf16 cache's bytes.
#include "amx.h"
#include "ops.h"
#include "simd.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryChunk = 8;
constexpr int64_t kKeySegment = 256;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// A cached head vector's scale: for an int8 cache the fp32 after its d values, else 1.
template <typename C>
inline float vector_scale(const C* p, int64_t d) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float scale;
    std::memcpy(&scale, p + d, sizeof(scale));
    return scale;
  } else {
    return 1.f;
  }
}

// Bytes of one cached head vector of d elements of type C (an int8 one with its scale).
template <typename C>
constexpr int64_t vector_bytes(int64_t d) {
  return std::is_same_v<C, int8_t> ? d + 4 : d * static_cast<int64_t>(sizeof(C));
}

template <typename T, int64_t D>
inline float dot(const T* __restrict k, const float* __restrict q, int64_t d) {
  if constexpr (D > 0) d = D;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += to_float(k[i]) * q[i];
  return s;
}

template <typename T, int64_t D>
inline void axpy(float a, const T* __restrict v, float* __restrict acc, int64_t d) {
  if constexpr (D > 0) d = D;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * to_float(v[i]);
}

// Query tokens [q_begin, q_end) of a row (row-relative), of each kv head's group the query
// heads [g_begin, g_end), and the key segments [seg_begin, seg_end). partial_base < 0: those
// are all the chunk's segments, folded as they come, and the item writes the output; else
// each segment's partial result is left in slot seg - partial_base for merge_partials.
struct WorkItem {
  int64_t row, q_begin, q_end, g_begin, g_end, seg_begin = 0, seg_end = 1, partial_base = -1;
};

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  int64_t q_stride_t, q_stride_h;              // q: [T, H, D]
  int64_t c_stride_b, c_stride_s, c_stride_h;  // caches: [num_blocks, block_size, Hkv, D]
  int64_t vec_bytes;                           // of one cached head vector (vector_bytes)
};

// The call's tensors. With a shared prefix (cascade attention), prefix_out/prefix_lse hold
// each query's attention over the prefix the caller computed ([T, H, D] and [T, H]); the
// rows' tables and k_lens then cover only what follows the prefix, and each query's two
// partial results are merged by their log-sum-exp. C: the caches' element type (bf16
// caches under fp32 queries: a bf16 KV cache for an fp32 model), T otherwise.
template <typename T, typename C = T>
struct Inputs {
  const T* q;
  T* out;
  const C *k_cache, *v_cache;
  const int64_t *tables, *q_starts, *q_lens, *k_lens;
  float scale;
  int64_t o_stride_t = 0, o_stride_h = 0;      // out: [T, H, D]
  const T* prefix_out = nullptr;
  const float* prefix_lse = nullptr;
  int64_t p_stride_t = 0, p_stride_h = 0, lse_stride_t = 0;
  int64_t window = 0;  // > 0: each query sees only its last `window` positions
  float softcap = 0.f;  // > 0: scores soft-capped
  float* partials = nullptr;  // [T, H, slots, D + 2]: a segment's acc, m and sum (WorkItem)
  int64_t part_stride_t = 0, part_stride_h = 0;
};

// The first key any query of item w sees (0 without a window): its first query's position
// minus window - 1.
template <typename T, typename C>
inline int64_t first_key(const WorkItem& w, const Inputs<T, C>& in) {
  if (in.window <= 0) return 0;
  const int64_t past = in.k_lens[w.row] - in.q_lens[w.row];
  return std::max<int64_t>(0, past + w.q_begin - in.window + 1);
}

// Writes query (token, head)'s output from its unnormalised accumulator acc (sum over its
// keys of e^(score - m) v) and sum (of e^(score - m)), merging the prefix part if any.
template <typename T, typename C>
inline void write_output(const float* acc, float m, float sum, int64_t token, int64_t head,
                         int64_t d, const Shapes& s, const Inputs<T, C>& in) {
  T* dst = in.out + token * in.o_stride_t + head * in.o_stride_h;
  if (in.prefix_out == nullptr) {
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[i] * inv);
    return;
  }
  const float lse = in.prefix_lse[token * in.lse_stride_t + head];
  const float top = std::max(m, lse);
  const float a = std::exp(m - top), b = std::exp(lse - top), inv = 1.f / (sum * a + b);
  const T* po = in.prefix_out + token * in.p_stride_t + head * in.p_stride_h;
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>((acc[i] * a + to_float(po[i]) * b) * inv);
}

// Folds a segment's partial result (acc, m, sum: as write_output takes them; m = -FLT_MAX,
// sum = 0 and acc = 0 where the query saw none of its keys) into a query's running one, in
// place. Starting from none (-FLT_MAX, 0, zeros), the first segment comes out exactly as
// it went in, and segments the query sees nothing of change nothing: so a row within one
// segment gets exactly the unsegmented result.
inline void fold_segment(float* acc_io, float& m_io, float& sum_io, const float* acc, float m,
                         float sum, int64_t d) {
  const float top = std::max(m_io, m);
  const float a = std::exp(m_io - top), b = std::exp(m - top);
  sum_io = sum_io * a + sum * b;
  for (int64_t i = 0; i < d; ++i) acc_io[i] = acc_io[i] * a + acc[i] * b;
  m_io = top;
}

// The running results of an item's query rows over its segments, and where they end up.
struct Running {
  float *acc, *m, *sum;  // [rows, d], [rows], [rows]
  void start(int64_t rows, int64_t d) {
    std::fill(acc, acc + rows * d, 0.f);
    std::fill(m, m + rows, -FLT_MAX);
    std::fill(sum, sum + rows, 0.f);
  }
  // Row r's result over segment seg (query (token, head)): folded in, or left as a partial.
  template <typename T, typename C>
  void segment(int64_t r, int64_t seg, const WorkItem& w, const float* acc_s, float m_s,
               float sum_s, int64_t token, int64_t head, int64_t d, const Inputs<T, C>& in) {
    if (w.partial_base < 0) {
      fold_segment(acc + r * d, m[r], sum[r], acc_s, m_s, sum_s, d);
      return;
    }
    float* dst = in.partials + token * in.part_stride_t + head * in.part_stride_h +
                 (seg - w.partial_base) * (d + 2);
    std::copy(acc_s, acc_s + d, dst);
    dst[d] = m_s;
    dst[d + 1] = sum_s;
  }
  // After the last segment: row r's output, unless its segments were left as partials.
  template <typename T, typename C>
  void finish(int64_t r, const WorkItem& w, int64_t token, int64_t head, int64_t d,
              const Shapes& s, const Inputs<T, C>& in) const {
    if (w.partial_base < 0) write_output(acc + r * d, m[r], sum[r], token, head, d, s, in);
  }
};

// Blocks lie anywhere in the pool, so no hardware prefetcher can guess the next one, and
// the few lines it runs ahead within a block do not cover memory's latency: the kernels
// request each vector they read kPrefetchBlocks blocks ahead, one key at a time (a burst
// of a whole block's requests stalls on the core's few fill buffers), into L2. Two blocks:
// on the Zen 5, one stream's 30 layers of SmolLM2 at 610 tokens of context with the cache
// evicted took 0.77-1.00 ms against 1.02-1.09 with one block ahead (its blocks scattered
// over the pool), 0.60-0.69 against 0.68-0.71 (in order), and a verify step's 5 query
// tokens 1.51-1.75 against 2.05-2.45 ms (scattered); three ran no better
// (docs/kernels.md, paged attention).
constexpr int64_t kPrefetchBlocks = 2;

// Requests the head vector of `bytes` bytes at p into L2.
inline void prefetch_vector(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(static_cast<const char*>(p) + c, 0, 2);
}

// Visits the cached tokens [begin, num_keys) of a row block by block: fn(j, n, base, ahead)
// for the n tokens j, j + 1, ... of one block, token j + o's vector for kv head h0 at
// base + o * s.c_stride_s (head h0 + i's i * s.c_stride_h further); ahead is the block
// kPrefetchBlocks on, from its first token (nullptr past the block of key ahead_end - 1:
// an item's segments after this one are requested too). Blocks before begin's are not read
// (nor their table entries).
template <typename T, typename Fn>
inline void for_each_block(const T* cache, const int64_t* table, int64_t begin, int64_t num_keys,
                           int64_t ahead_end, int64_t h0, const Shapes& s, Fn&& fn) {
  const int64_t num_blocks = (ahead_end + s.block_size - 1) / s.block_size;
  for (int64_t b = begin / s.block_size, j = begin; j < num_keys; ++b) {
    const T* ahead = b + kPrefetchBlocks < num_blocks
                         ? cache + table[b + kPrefetchBlocks] * s.c_stride_b + h0 * s.c_stride_h
                         : nullptr;
    const int64_t o0 = j - b * s.block_size;  // 0 but in begin's block
    const int64_t n = std::min(s.block_size - o0, num_keys - j);
    fn(j, n, cache + table[b] * s.c_stride_b + o0 * s.c_stride_s + h0 * s.c_stride_h, ahead);
    j += n;
  }
}

// One kv head's vectors one token at a time: fn(j, pointer to token j's vector).
template <typename T, typename Fn>
inline void for_each_key(const T* cache, const int64_t* table, int64_t begin, int64_t num_keys,
                         int64_t ahead_end, int64_t kv_head, const Shapes& s, Fn&& fn) {
  const int64_t bytes = s.vec_bytes;
  for_each_block(cache, table, begin, num_keys, ahead_end, kv_head, s,
                 [&](int64_t j, int64_t n, const T* base, const T* ahead) {
                   for (int64_t o = 0; o < n; ++o) {
                     if (ahead != nullptr) prefetch_vector(ahead + o * s.c_stride_s, bytes);
                     fn(j + o, base + o * s.c_stride_s);
                   }
                 });
}

// One kv head of an item. D > 0: the head dim known at compile time (fully unrolled,
// vectorised loops); D == 0: any.
template <typename T, int64_t D, typename C = T>
void attend_head(const WorkItem& w, int64_t kv_head, const Shapes& s, const Inputs<T, C>& in,
                 std::vector<float>& buf) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = D > 0 ? D : s.head_dim;
  const int64_t gn = w.g_end - w.g_begin, num_q = w.q_end - w.q_begin, rows = num_q * gn;
  const int64_t q_len = in.q_lens[w.row], k_len = in.k_lens[w.row];
  const int64_t past = k_len - q_len;          // tokens before the row's first new token
  const int64_t chunk_end = past + w.q_end;    // keys seen by the chunk's last query
  const int64_t* table = in.tables + w.row * s.table_width;
  const int64_t first_token = in.q_starts[w.row] + w.q_begin;
  const int64_t chunk_begin = first_key(w, in);  // the first key any query sees
  const int64_t width = std::min(kKeySegment, chunk_end - chunk_begin);
  const int64_t item_end = std::min(chunk_end, w.seg_end * kKeySegment);  // its last key + 1
  buf.resize(rows * (width + 3 * d + 4));
  float* scores = buf.data();                  // [rows, width]: the segment's keys
  float* qf = scores + rows * width;           // [rows, d], scaled queries
  float* acc = qf + rows * d;                  // [rows, d]
  float* row_max = acc + rows * d;             // [rows]
  float* row_sum = row_max + rows;             // [rows]
  Running run{row_sum + rows, row_sum + rows + rows * d, row_sum + 2 * rows + rows * d};
  run.start(rows, d);
  // Query r = (token t, head g_begin + g) sees keys [0, past + q_begin + t].
  for (int64_t t = 0; t < num_q; ++t) {
    for (int64_t g = 0; g < gn; ++g) {
      const T* src = in.q + (first_token + t) * s.q_stride_t + (kv_head * group + w.g_begin + g) * s.q_stride_h;
      float* dst = qf + (t * gn + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * in.scale;
    }
  }
  const int64_t first_unmasked = past + w.q_begin;  // keys every query of the chunk sees
  for (int64_t seg = w.seg_begin; seg < w.seg_end; ++seg) {
    const int64_t begin = std::max(chunk_begin, seg * kKeySegment);
    const int64_t num_keys = std::min(chunk_end, (seg + 1) * kKeySegment);
    const int64_t span = num_keys - begin;
    for_each_key(in.k_cache, table, begin, num_keys, item_end, kv_head, s, [&](int64_t j, const C* kj) {
      const int64_t first_r = j <= first_unmasked ? 0 : (j - first_unmasked) * gn;
      const float ks = vector_scale(kj, d);  // 1 (exact) but for an int8 cache
      for (int64_t r = first_r; r < rows; ++r) scores[r * span + j - begin] = dot<C, D>(kj, qf + r * d, d) * ks;
    });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t last = first_unmasked + r / gn + 1;  // keys [.., last) of the row
      const int64_t n = std::clamp<int64_t>(last - begin, 0, span);  // keys [lo, n) of the span
      const int64_t lo = in.window > 0 ? std::clamp<int64_t>(last - in.window - begin, 0, n) : 0;
      float* sc = scores + r * span;
      std::fill(sc, sc + lo, 0.f);  // outside the window: weight 0
      if (in.softcap > 0.f)
        for (int64_t j = lo; j < n; ++j) sc[j] = std::tanh(sc[j] / in.softcap) * in.softcap;
      float m = -FLT_MAX;
      for (int64_t j = lo; j < n; ++j) m = std::max(m, sc[j]);
      float sum = 0.f;
      for (int64_t j = lo; j < n; ++j) {
        sc[j] = std::exp(sc[j] - m);
        sum += sc[j];
      }
      row_max[r] = m;
      row_sum[r] = sum;
    }
    std::fill(acc, acc + rows * d, 0.f);
    for_each_key(in.v_cache, table, begin, num_keys, item_end, kv_head, s, [&](int64_t j, const C* vj) {
      const int64_t first_r = j <= first_unmasked ? 0 : (j - first_unmasked) * gn;
      const float vs = vector_scale(vj, d);
      for (int64_t r = first_r; r < rows; ++r) axpy<C, D>(scores[r * span + j - begin] * vs, vj, acc + r * d, d);
    });
    for (int64_t r = 0; r < rows; ++r)
      run.segment(r, seg, w, acc + r * d, row_max[r], row_sum[r], first_token + r / gn,
                  kv_head * group + w.g_begin + r % gn, d, in);
  }
  for (int64_t r = 0; r < rows; ++r)
    run.finish(r, w, first_token + r / gn, kv_head * group + w.g_begin + r % gn, d, s, in);
}

template <typename T, int64_t D, typename C = T>
void attend_item(const WorkItem& w, int64_t h_begin, int64_t h_end, const Shapes& s,
                 const Inputs<T, C>& in, std::vector<float>& buf) {
  for (int64_t h = h_begin; h < h_end; ++h) attend_head<T, D, C>(w, h, s, in, buf);
}

#if defined(__AVX512F__)
using pagedllm::exp16;
using pagedllm::load16;

// ---- AVX-512 path: one key's head vector in NV registers of 16 floats -------------------

// The kernels below work on the n keys of one block (key o's vector at base + o * s.c_stride_s)
// for NR query rows at a time, scores and probabilities at [r * stride + o].

// Scores of NR query vectors (qf rows, fp32, pre-scaled): the queries stay in registers,
// each key is loaded and widened once for all of them.
template <typename T, int NV, int NR>
void score_block(const float* qf, float* scores, int64_t stride, const T* base, const T* ahead,
                 int64_t n, const Shapes& s) {
  __m512 qv[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) qv[r][i] = _mm512_loadu_ps(qf + r * NV * 16 + i * 16);
  for (int64_t o = 0; o < n; ++o) {
    const T* kj = base + o * s.c_stride_s;
    if (ahead != nullptr) prefetch_vector(ahead + o * s.c_stride_s, NV * 16 * sizeof(T));
    __m512 kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load16(kj + i * 16);
    for (int r = 0; r < NR; ++r) {
      __m512 acc = _mm512_mul_ps(kv[0], qv[r][0]);
      for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(kv[i], qv[r][i], acc);
      scores[r * stride + o] = _mm512_reduce_add_ps(acc);
    }
  }
}

// acc[r] += sum_o p[r][o] v_o for NR rows (acc: NR rows of NV * 16 floats).
template <typename T, int NV, int NR>
void weigh_block(const float* probs, int64_t stride, float* acc_io, const T* base, const T* ahead,
                 int64_t n, const Shapes& s) {
  __m512 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(acc_io + r * NV * 16 + i * 16);
  for (int64_t o = 0; o < n; ++o) {
    const T* vj = base + o * s.c_stride_s;
    if (ahead != nullptr) prefetch_vector(ahead + o * s.c_stride_s, NV * 16 * sizeof(T));
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(vj + i * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * stride + o]);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(p, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_io + r * NV * 16 + i * 16, acc[r][i]);
}

// In place: row[0:n] = exp(row - max) (the unnormalised softmax), row[n:width] = 0;
// returns the sum, and the max in *max_out.
inline float softmax_row(float* row, int64_t n, int64_t width, float* max_out) {
  __m512 m = _mm512_set1_ps(-FLT_MAX);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, row + j));
  }
  *max_out = _mm512_reduce_max_ps(m);
  const __m512 mx = _mm512_set1_ps(*max_out);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), mx));
    sum = _mm512_mask_add_ps(sum, k, sum, e);
    _mm512_mask_storeu_ps(row + j, k, e);
  }
  std::fill(row + n, row + width, 0.f);
  return _mm512_reduce_add_ps(sum);
}

// softmax_row over row[lo:n] (row[0:lo], before the query's window, zeroed too), the
// scores soft-capped first if softcap > 0.
inline float softmax_window(float* row, int64_t lo, int64_t n, int64_t width, float softcap,
                            float* max_out) {
  std::fill(row, row + lo, 0.f);
  if (softcap > 0.f)
    for (int64_t j = lo; j < n; j += 16) {
      const __mmask16 k = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm512_mask_storeu_ps(row + j, k, pagedllm::softcap16(_mm512_maskz_loadu_ps(k, row + j), softcap));
    }
  return softmax_row(row + lo, n - lo, width - lo, max_out);
}

// ---- bf16 caches: fewer vector instructions per key ----------------------------------------
// The two 512-bit vector ports bound the kernel's compute (every shuffle, add and multiply
// takes one; on the AMX Xeon measured, VDPBF16PS issues at a quarter of the FMA rate, half
// its multiplies, so it does not help). For bf16: a register of 32 bf16 is widened to fp32
// as its even and odd elements (a shift and a mask, no shuffle), matched by the query split
// the same way, and the scores of 8 keys are summed by one transposing reduction instead
// of a horizontal sum per key: 15% fewer cycles per key than the generic path in cache.
using BF16 = c10::BFloat16;

// The even and odd elements of 32 bf16 (one register) as two vectors of 16 floats.
inline void widen_even_odd(const BF16* p, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The lane sums of 8 vectors: element 4L of the result holds a[L]'s, element 4L + 2
// a[4 + L]'s (L < 4). Each level adds the two halves of every pair: 256-bit halves,
// 128-bit quarters, float pairs, then neighbours.
inline __m512 sum8(const __m512 (&a)[8]) {
  __m512 w[4], y[2];
  for (int p = 0; p < 4; ++p)
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int p = 0; p < 2; ++p)
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0xDD));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
  return _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0xB1));
}

// Scores of NR query rows, 8 keys at a time (past the block's last key: its first again,
// not stored). q_eo: per row 2 * NP vectors, the even then the odd elements of each 32 of
// the pre-scaled fp32 query.
template <int NV, int NR>
void score_block_bf16(const float* q_eo, float* scores, int64_t stride, const BF16* base,
                      const BF16* ahead, int64_t n, const Shapes& s) {
  constexpr int NP = NV / 2;
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t o = 0; o < n; o += 8) {
    const int64_t m = std::min<int64_t>(8, n - o);
    __m512 acc[NR][8];
    for (int i = 0; i < 8; ++i) {
      const BF16* key = base + (o + (i < m ? i : 0)) * s.c_stride_s;
      if (ahead != nullptr && i < m) prefetch_vector(ahead + (o + i) * s.c_stride_s, NV * 32);
      __m512 even[NP], odd[NP];
      for (int p = 0; p < NP; ++p) widen_even_odd(key + 32 * p, even[p], odd[p]);
      for (int r = 0; r < NR; ++r) {
        const float* q = q_eo + r * NV * 16;
        __m512 a = _mm512_mul_ps(even[0], _mm512_loadu_ps(q));
        a = _mm512_fmadd_ps(odd[0], _mm512_loadu_ps(q + 16), a);
        for (int p = 1; p < NP; ++p) {
          a = _mm512_fmadd_ps(even[p], _mm512_loadu_ps(q + 32 * p), a);
          a = _mm512_fmadd_ps(odd[p], _mm512_loadu_ps(q + 32 * p + 16), a);
        }
        acc[r][i] = a;
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
    for (int r = 0; r < NR; ++r)
      _mm512_mask_storeu_ps(scores + r * stride + o, mask, _mm512_permutexvar_ps(order, sum8(acc[r])));
  }
}

#if defined(PAGEDLLM_BF16_DOT)
// Scores by AVX512-BF16 dot products where the CPU has them: one instruction multiplies 32
// bf16 of a key by the same 32 of a query and adds each pair of products into one of 16
// fp32 lanes, so keys are not widened and the queries (bf16, unscaled) stay in registers.
// Measured on the 2-core Zen 5, 30 layers of 64 decode rows over 380 tokens: 10-14%
// faster in cache, 6-14% from memory. Products and sums are fp32 as in the widening path; only the
// order of the additions differs. (The same for the values, with the probabilities
// rounded to bf16, was faster in cache but not from memory: they keep fp32.)
// Not on the AMX Xeon, where VDPBF16PS issues at a quarter of the FMA rate: there the
// widening path decoded 2-16% faster (1-16 rows of 9, 16 and 32 query heads over 300-3000
// keys, 2 threads), so CPUs with AMX widen (tests may still ask for dot products).
std::atomic<bool> dot_scores_allowed{!pagedllm::amx_available()};

// Scores of NR query rows (q: per row NV * 16 bf16), 8 keys at a time as score_block_bf16.
template <int NV, int NR>
void score_block_dot(const BF16* q, float scale, float* scores, int64_t stride, const BF16* base,
                     const BF16* ahead, int64_t n, const Shapes& s) {
  constexpr int NP = NV / 2;  // registers of 32 bf16 per head vector
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 sc = _mm512_set1_ps(scale);
  __m512bh qv[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) qv[r][p] = (__m512bh)_mm512_loadu_si512(q + r * NV * 16 + 32 * p);
  for (int64_t o = 0; o < n; o += 8) {
    const int64_t m = std::min<int64_t>(8, n - o);
    __m512bh kv[8][NP];
    for (int i = 0; i < 8; ++i) {
      const BF16* key = base + (o + (i < m ? i : 0)) * s.c_stride_s;
      if (ahead != nullptr && i < m) prefetch_vector(ahead + (o + i) * s.c_stride_s, NV * 32);
      for (int p = 0; p < NP; ++p) kv[i][p] = (__m512bh)_mm512_loadu_si512(key + 32 * p);
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
    for (int r = 0; r < NR; ++r) {
      __m512 acc[8];
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), kv[i][0], qv[r][0]);
        for (int p = 1; p < NP; ++p) acc[i] = _mm512_dpbf16_ps(acc[i], kv[i][p], qv[r][p]);
      }
      _mm512_mask_storeu_ps(scores + r * stride + o, mask,
                            _mm512_mul_ps(_mm512_permutexvar_ps(order, sum8(acc)), sc));
    }
  }
}
#endif  // PAGEDLLM_BF16_DOT

// acc[r] += sum_o p[r][o] v_o for NR rows, kept as even and odd elements: each 32 of a
// row's NV * 16 floats holds the even elements, then the odd ones (interleave_even_odd
// puts them back in order).
template <int NV, int NR>
void weigh_block_bf16(const float* probs, int64_t stride, float* acc_eo, const BF16* base,
                      const BF16* ahead, int64_t n, const Shapes& s) {
  constexpr int NP = NV / 2;
  __m512 acc[NR][NV];  // [r][2p]: even elements of the p-th 32, [r][2p + 1]: odd
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(acc_eo + r * NV * 16 + i * 16);
  for (int64_t o = 0; o < n; ++o) {
    if (ahead != nullptr) prefetch_vector(ahead + o * s.c_stride_s, NV * 32);
    __m512 even[NP], odd[NP];
    for (int p = 0; p < NP; ++p) widen_even_odd(base + o * s.c_stride_s + 32 * p, even[p], odd[p]);
    for (int r = 0; r < NR; ++r) {
      const __m512 pr = _mm512_set1_ps(probs[r * stride + o]);
      for (int p = 0; p < NP; ++p) {
        acc[r][2 * p] = _mm512_fmadd_ps(pr, even[p], acc[r][2 * p]);
        acc[r][2 * p + 1] = _mm512_fmadd_ps(pr, odd[p], acc[r][2 * p + 1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_eo + r * NV * 16 + i * 16, acc[r][i]);
}

// ---- int8 caches: 16 values widened to fp32 at a time, the scale applied once a key ------
// Scores of NR query rows (qf, fp32, pre-scaled), 8 keys at a time (past the block's last
// key: its first again, not stored): each key's dot products, summed by one transposing
// reduction for the 8 keys, times the 8 keys' scales.
template <int NV, int NR>
void score_block_i8(const float* qf, float* scores, int64_t stride, const int8_t* base,
                    const int8_t* ahead, int64_t n, const Shapes& s) {
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t o = 0; o < n; o += 8) {
    const int64_t m = std::min<int64_t>(8, n - o);
    __m512 acc[NR][8];
    float scale[8];
    for (int i = 0; i < 8; ++i) {
      const int8_t* key = base + (o + (i < m ? i : 0)) * s.c_stride_s;
      if (ahead != nullptr && i < m) prefetch_vector(ahead + (o + i) * s.c_stride_s, s.vec_bytes);
      __m512 kv[NV];
      for (int p = 0; p < NV; ++p) kv[p] = load16(key + 16 * p);
      scale[i] = vector_scale(key, NV * 16);
      for (int r = 0; r < NR; ++r) {
        const float* q = qf + r * NV * 16;
        __m512 a = _mm512_mul_ps(kv[0], _mm512_loadu_ps(q));
        for (int p = 1; p < NV; ++p) a = _mm512_fmadd_ps(kv[p], _mm512_loadu_ps(q + 16 * p), a);
        acc[r][i] = a;
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
    const __m512 sc = _mm512_maskz_loadu_ps(0xFF, scale);
    for (int r = 0; r < NR; ++r)
      _mm512_mask_storeu_ps(scores + r * stride + o, mask,
                            _mm512_mul_ps(_mm512_permutexvar_ps(order, sum8(acc[r])), sc));
  }
}

// acc[r] += sum_o p[r][o] scale_o v_o for NR rows (acc: NR rows of NV * 16 floats).
template <int NV, int NR>
void weigh_block_i8(const float* probs, int64_t stride, float* acc_io, const int8_t* base,
                    const int8_t* ahead, int64_t n, const Shapes& s) {
  __m512 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(acc_io + r * NV * 16 + i * 16);
  for (int64_t o = 0; o < n; ++o) {
    const int8_t* vj = base + o * s.c_stride_s;
    if (ahead != nullptr) prefetch_vector(ahead + o * s.c_stride_s, s.vec_bytes);
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(vj + i * 16);
    const float vs = vector_scale(vj, NV * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * stride + o] * vs);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(p, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_io + r * NV * 16 + i * 16, acc[r][i]);
}

// In place, for n floats (a multiple of 32): each 32 from its even then odd elements back
// to their order.
inline void interleave_even_odd(float* x, int64_t n) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 even = _mm512_loadu_ps(x + i), odd = _mm512_loadu_ps(x + i + 16);
    _mm512_storeu_ps(x + i, _mm512_permutex2var_ps(even, low, odd));
    _mm512_storeu_ps(x + i + 16, _mm512_permutex2var_ps(even, high, odd));
  }
}

// Query rows in groups of up to 4 held in registers (the 3 query heads of a GQA group in
// a decode are one group): dispatch a group size known at compile time.
template <typename T, int NV, template <typename, int, int> class Kernel, typename... Args>
void by_rows(int64_t nr, Args... args) {
  switch (nr) {
    case 1: Kernel<T, NV, 1>::run(args...); break;
    case 2: Kernel<T, NV, 2>::run(args...); break;
    case 3: Kernel<T, NV, 3>::run(args...); break;
    default: Kernel<T, NV, 4>::run(args...); break;
  }
}
// By the cache's type: bf16 takes its own kernels (its queries split in even and odd
// elements for the scores), int8 its own.
template <typename C, int NV, int NR> struct Score {
  template <typename... A> static void run(A... a) {
    if constexpr (std::is_same_v<C, BF16>) score_block_bf16<NV, NR>(a...);
    else if constexpr (std::is_same_v<C, int8_t>) score_block_i8<NV, NR>(a...);
    else score_block<C, NV, NR>(a...);
  }
};
#if defined(PAGEDLLM_BF16_DOT)
template <typename T, int NV, int NR> struct ScoreDot {
  template <typename... A> static void run(A... a) { score_block_dot<NV, NR>(a...); }
};
#endif
template <typename C, int NV, int NR> struct Weigh {
  template <typename... A> static void run(A... a) {
    if constexpr (std::is_same_v<C, BF16>) weigh_block_bf16<NV, NR>(a...);
    else if constexpr (std::is_same_v<C, int8_t>) weigh_block_i8<NV, NR>(a...);
    else weigh_block<C, NV, NR>(a...);
  }
};

// Kv heads [h_begin, h_end) of an item: two passes over the row's blocks, keys then values,
// each block's vectors of every head of the item used while it is in cache (and the next
// blocks' requested meanwhile, so memory streams during all the work, not one head's).
// Queries of type T over a cache of type C: the same type, or an int8 cache.
template <typename T, typename C, int NV>
void attend_item_simd(const WorkItem& w, int64_t h_begin, int64_t h_end, const Shapes& s,
                      const Inputs<T, C>& in, std::vector<float>& buf) {
  constexpr int64_t d = NV * 16, kRowBlock = 4;
  constexpr bool kBf16 = std::is_same_v<C, c10::BFloat16>;
  static_assert(std::is_same_v<T, C> || std::is_same_v<C, int8_t>);
  const int64_t group = s.num_heads / s.num_kv_heads, gn = w.g_end - w.g_begin;
  const int64_t per_head = (w.q_end - w.q_begin) * gn, rows = (h_end - h_begin) * per_head;
  const int64_t past = in.k_lens[w.row] - in.q_lens[w.row];
  const int64_t chunk_end = past + w.q_end;         // keys seen by the chunk's last query
  const int64_t first_unmasked = past + w.q_begin;  // keys every query of the chunk sees
  const int64_t* table = in.tables + w.row * s.table_width;
  const int64_t first_token = in.q_starts[w.row] + w.q_begin;
  const int64_t chunk_begin = first_key(w, in);     // the first key any query sees
  const int64_t width = std::min(kKeySegment, chunk_end - chunk_begin);  // scores a segment keeps
  const int64_t item_end = std::min(chunk_end, w.seg_end * kKeySegment);  // its last key + 1
  // Row r is kv head h_begin + r / per_head's query (token t, head g_begin + g of its
  // group), with r % per_head = t * gn + g; it sees keys [0, first_unmasked + t].
  auto token_of = [&](int64_t r) { return (r % per_head) / gn; };
  auto head_of = [&](int64_t r) { return (h_begin + r / per_head) * group + w.g_begin + r % gn; };
  // scores [rows, width], then qf [rows, d] (scaled fp32 queries), acc [rows, d], row_max
  // and row_sum [rows], the running results (acc, m, sum), and for bf16 the queries split
  // in even and odd elements (or, for dot products, the bf16 queries in the same place).
  buf.resize(rows * (width + 3 * d + 4) + (kBf16 ? rows * d : 0));
  float* scores = buf.data();
  float* qf = scores + rows * width;
  float* acc = qf + rows * d;
  float* row_max = acc + rows * d;
  float* row_sum = row_max + rows;
  Running run{row_sum + rows, row_sum + rows + rows * d, row_sum + 2 * rows + rows * d};
  float* q_extra = run.sum + rows;
  run.start(rows, d);
  auto q_row = [&](int64_t r) {
    return in.q + (first_token + token_of(r)) * s.q_stride_t + head_of(r) * s.q_stride_h;
  };
  [[maybe_unused]] BF16* q_dot = nullptr;  // the bf16 queries, where dot products score
#if defined(PAGEDLLM_BF16_DOT)
  if constexpr (kBf16) {
    if (dot_scores_allowed.load(std::memory_order_relaxed)) {
      q_dot = reinterpret_cast<BF16*>(q_extra);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(q_dot + r * d, q_row(r), d * sizeof(BF16));
    }
  }
#endif
  const float* q_score = qf;  // the queries as the widening score kernels take them
  if (q_dot == nullptr) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < d; ++i) qf[r * d + i] = to_float(q_row(r)[i]) * in.scale;
    if constexpr (kBf16) {
      float* q_eo = q_extra;  // each 32 of qf: its even elements, then its odd ones
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      for (int64_t i = 0; i < rows * d; i += 32) {
        const __m512 a = _mm512_loadu_ps(qf + i), b = _mm512_loadu_ps(qf + i + 16);
        _mm512_storeu_ps(q_eo + i, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(q_eo + i + 16, _mm512_permutex2var_ps(a, odd, b));
      }
      q_score = q_eo;
    }
  }
  for (int64_t seg = w.seg_begin; seg < w.seg_end; ++seg) {
    const int64_t begin = std::max(chunk_begin, seg * kKeySegment);  // the segment's keys
    const int64_t num_keys = std::min(chunk_end, (seg + 1) * kKeySegment);
    const int64_t span = num_keys - begin;
    // row r's keys in the segment end before keys_of(r) (at or before begin: none)
    auto keys_of = [&](int64_t r) { return std::min(first_unmasked + token_of(r) + 1, num_keys); };
    // fn(r0, nr, n, head_base, head_ahead) for each block of up to kRowBlock rows of one kv
    // head whose last row sees any of the block's keys: the first n of them it sees (the
    // surplus of the other rows is zeroed by softmax_row). The last block of a head's rows
    // (which sees the most keys) prefetches the head's vectors of the block ahead.
    auto for_each_row_block = [&](int64_t j, int64_t n, const C* base, const C* ahead, auto&& fn) {
      for (int64_t r0 = 0, nr; r0 < rows; r0 += nr) {
        const int64_t hi = r0 / per_head;
        nr = std::min(kRowBlock, (hi + 1) * per_head - r0);
        const int64_t m = std::min(n, keys_of(r0 + nr - 1) - j);
        const bool last = r0 + nr == (hi + 1) * per_head && ahead != nullptr;
        if (m > 0) fn(r0, nr, m, base + hi * s.c_stride_h, last ? ahead + hi * s.c_stride_h : nullptr);
      }
    };
    for_each_block(in.k_cache, table, begin, num_keys, item_end, h_begin, s,
                   [&](int64_t j, int64_t n, const C* base, const C* ahead) {
                     for_each_row_block(j, n, base, ahead,
                                        [&](int64_t r0, int64_t nr, int64_t m, const C* kb, const C* ka) {
#if defined(PAGEDLLM_BF16_DOT)
                                          if constexpr (kBf16) {
                                            if (q_dot != nullptr) {
                                              by_rows<C, NV, ScoreDot>(nr, static_cast<const BF16*>(q_dot + r0 * d),
                                                                       in.scale, scores + r0 * span + j - begin,
                                                                       span, kb, ka, m, s);
                                              return;
                                            }
                                          }
#endif
                                          by_rows<C, NV, Score>(nr, q_score + r0 * d,
                                                                scores + r0 * span + j - begin, span,
                                                                kb, ka, m, s);
                                        });
                   });
    {
      // The value pass's first block (no block before it prefetches it), requested while the
      // softmax computes: 3-10% faster from memory in one-process A/B runs on the Zen 5.
      const int64_t b0 = begin / s.block_size, o0 = begin - b0 * s.block_size;
      const C* first = in.v_cache + table[b0] * s.c_stride_b + o0 * s.c_stride_s;
      const int64_t n0 = std::min(s.block_size - o0, span);
      for (int64_t o = 0; o < n0; ++o)
        for (int64_t h = h_begin; h < h_end; ++h)
          prefetch_vector(first + o * s.c_stride_s + h * s.c_stride_h, s.vec_bytes);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::max<int64_t>(0, keys_of(r) - begin);
      if (in.window <= 0 && in.softcap <= 0.f) {
        row_sum[r] = softmax_row(scores + r * span, n, span, row_max + r);
      } else {  // row r's window: keys [first_unmasked + t + 1 - window, ..)
        const int64_t end = first_unmasked + token_of(r) + 1;
        const int64_t lo = in.window > 0 ? std::clamp<int64_t>(end - in.window - begin, 0, n) : 0;
        row_sum[r] = softmax_window(scores + r * span, lo, n, span, in.softcap, row_max + r);
      }
    }
    std::fill(acc, acc + rows * d, 0.f);
    for_each_block(in.v_cache, table, begin, num_keys, item_end, h_begin, s,
                   [&](int64_t j, int64_t n, const C* base, const C* ahead) {
                     for_each_row_block(j, n, base, ahead,
                                        [&](int64_t r0, int64_t nr, int64_t m, const C* vb, const C* va) {
                                          by_rows<C, NV, Weigh>(nr, static_cast<const float*>(scores + r0 * span + j - begin),
                                                                span, acc + r0 * d, vb, va, m, s);
                                        });
                   });
    if constexpr (kBf16) interleave_even_odd(acc, rows * d);
    for (int64_t r = 0; r < rows; ++r)
      run.segment(r, seg, w, acc + r * d, row_max[r], row_sum[r], first_token + token_of(r),
                  head_of(r), d, in);
  }
  for (int64_t r = 0; r < rows; ++r)
    run.finish(r, w, first_token + token_of(r), head_of(r), d, s, in);
}
#endif  // __AVX512F__

template <typename T, typename C = T>
using ItemFn = void (*)(const WorkItem&, int64_t, int64_t, const Shapes&, const Inputs<T, C>&,
                        std::vector<float>&);

// The item function for queries of type T over caches of type C: the AVX-512 kernels where
// both are one type or the cache is int8, else the compiler-vectorised one (fp32 queries
// over a bf16 cache).
template <typename T, typename C>
ItemFn<T, C> pick_item_fn(int64_t head_dim) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, C> || std::is_same_v<C, int8_t>) {
    if (head_dim == 64) return attend_item_simd<T, C, 4>;
    if (head_dim == 128) return attend_item_simd<T, C, 8>;
    if (head_dim == 256) return attend_item_simd<T, C, 16>;
  }
#endif
  return head_dim == 64 ? attend_item<T, 64, C> : head_dim == 128 ? attend_item<T, 128, C>
                                                                  : attend_item<T, 0, C>;
}

// The outputs of the queries of unit w (its chunk's tokens, kv head kv_head's query heads
// [g_begin, g_end)) from the partial results of its segments, folded in order (as an item
// over all of them folds them).
template <typename T, typename C>
void merge_partials(const WorkItem& w, int64_t kv_head, const Shapes& s, const Inputs<T, C>& in,
                    std::vector<float>& acc) {
  const int64_t d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  acc.resize(d);
  for (int64_t token = in.q_starts[w.row] + w.q_begin, t = w.q_begin; t < w.q_end; ++token, ++t) {
    for (int64_t head = kv_head * group + w.g_begin; head < kv_head * group + w.g_end; ++head) {
      const float* part = in.partials + token * in.part_stride_t + head * in.part_stride_h;
      float m = -FLT_MAX, sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t seg = w.seg_begin; seg < w.seg_end; ++seg, part += d + 2)
        fold_segment(acc.data(), m, sum, part, part[d], part[d + 1], d);
      write_output(acc.data(), m, sum, token, head, d, s, in);
    }
  }
}

template <typename T, typename C = T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
         const at::Tensor& k_lens, float scale, const c10::optional<at::Tensor>& prefix_out,
         const c10::optional<at::Tensor>& prefix_lse, int64_t window, float softcap) {
  const Shapes s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
                 q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                 vector_bytes<C>(q.size(2))};
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* kl = k_lens.data_ptr<int64_t>();
  Inputs<T, C> in{q.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                block_tables.data_ptr<int64_t>(), q_starts.data_ptr<int64_t>(), ql, kl, scale,
                out.stride(0), out.stride(1)};
  in.window = window;
  in.softcap = softcap;
  if (prefix_out.has_value()) {
    in.prefix_out = prefix_out->data_ptr<T>();
    in.prefix_lse = prefix_lse->data_ptr<float>();
    in.p_stride_t = prefix_out->stride(0);
    in.p_stride_h = prefix_out->stride(1);
    in.lse_stride_t = prefix_lse->stride(0);
  }
  const ItemFn<T, C> item_fn = pick_item_fn<T, C>(s.head_dim);
  const int64_t threads = at::get_num_threads();
  const int64_t group = s.num_heads / s.num_kv_heads;
  // a chunk's key segments [first, end) and the keys of segment seg it reads
  auto segments_of = [&](const WorkItem& w) {
    const int64_t past = kl[w.row] - ql[w.row];
    return std::make_pair(first_key(w, in) / kKeySegment, (past + w.q_end - 1) / kKeySegment + 1);
  };
  auto keys_in = [&](const WorkItem& w, int64_t seg) {
    const int64_t past = kl[w.row] - ql[w.row];
    return std::min(past + w.q_end, (seg + 1) * kKeySegment) -
           std::max(first_key(w, in), seg * kKeySegment);
  };
  // (row, chunk of query tokens) items, split further in split times as many chunks
  auto make_chunks = [&](int64_t split) {
    std::vector<WorkItem> chunks;
    for (int64_t row = 0; row < q_lens.size(0); ++row) {
      const int64_t c = std::min(ql[row], (ql[row] + kQueryChunk - 1) / kQueryChunk * split);
      for (int64_t i = 0; i < c; ++i) {
        WorkItem w{row, ql[row] * i / c, ql[row] * (i + 1) / c, 0, group};
        std::tie(w.seg_begin, w.seg_end) = segments_of(w);
        chunks.push_back(w);
      }
    }
    return chunks;
  };
  std::vector<WorkItem> chunks = make_chunks(1);
  if (static_cast<int64_t>(chunks.size()) >= 4 * threads) {
    // Enough chunks for every thread: an item is a whole chunk, all kv heads, all segments
    // (it reads each block of its row once, whole and in order), largest first, handed out
    // one at a time (rows' contexts differ a lot: a static split leaves a thread idle).
    auto cost = [&](const WorkItem& w) {
      int64_t keys = 0;
      for (int64_t seg = w.seg_begin; seg < w.seg_end; ++seg) keys += keys_in(w, seg);
      return (w.q_end - w.q_begin) * keys;
    };
    std::stable_sort(chunks.begin(), chunks.end(),
                     [&](const WorkItem& a, const WorkItem& b) { return cost(a) > cost(b); });
    const int64_t n = static_cast<int64_t>(chunks.size());
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> buf;
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;)
        item_fn(chunks[i], 0, s.num_kv_heads, s, in, buf);
    });
    return;
  }
  // Few chunks (a single stream's decode or verify step): the work is a run of units, each
  // a (chunk, kv head) — with fewer of them than threads (Gemma 3 1B's one kv head over a
  // short context), a (smaller chunk, kv head, part of its group of query heads), the parts
  // of one kv head next to each other — each a run of key segments, cut in one contiguous
  // piece of about equal keys per thread at segment edges: each thread streams its keys in
  // order, and a unit cut in two leaves its segments' partial results, merged by whichever
  // thread finishes the unit's last item. Every query's sums are the same as in a batch.
  int64_t units = 0;  // a last segment of under half a segment's keys not counted
  for (const WorkItem& w : chunks)
    units += (w.seg_end - w.seg_begin - (w.seg_end - w.seg_begin > 1 &&
                                         2 * keys_in(w, w.seg_end - 1) < kKeySegment)) * s.num_kv_heads;
  const int64_t split = 0 < units && units < threads ? (threads + units - 1) / units : 1;
  const int64_t num_before = static_cast<int64_t>(chunks.size());
  if (split > 1) chunks = make_chunks(split);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const int64_t parts = num_chunks > 0 ? std::min(group, (split * num_before + num_chunks - 1) / num_chunks) : 1;
  int64_t total = 0;
  for (const WorkItem& w : chunks)
    for (int64_t seg = w.seg_begin; seg < w.seg_end; ++seg) total += keys_in(w, seg) * (w.q_end - w.q_begin);
  total *= s.num_kv_heads * parts;
  struct Item {
    WorkItem w;
    int64_t kv_head, unit, thread;
  };
  struct Cut {  // a unit cut between threads
    WorkItem whole;
    int64_t kv_head, items;  // its items, each leaving partials; the last merges them
  };
  std::vector<Item> items;  // by thread, each thread's in order
  std::vector<Cut> cut;
  int64_t done = 0;  // cost of the segments before
  for (const WorkItem& chunk : chunks) {
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      for (int64_t p = 0; p < parts; ++p) {
        WorkItem w = chunk;
        w.g_begin = group * p / parts;
        w.g_end = group * (p + 1) / parts;
        const size_t first_item = items.size();
        for (int64_t seg = chunk.seg_begin; seg < chunk.seg_end; ++seg) {
          const int64_t cost = keys_in(chunk, seg) * (chunk.q_end - chunk.q_begin);
          // the thread whose share holds the segment's middle
          const int64_t t = total > 0 ? std::min<int64_t>(threads - 1, (2 * done + cost) * threads / (2 * total)) : 0;
          done += cost;
          if (items.size() > first_item && items.back().thread == t) {
            ++items.back().w.seg_end;  // the unit's next segment, on the same thread
            continue;
          }
          w.seg_begin = seg;
          w.seg_end = seg + 1;
          items.push_back({w, h, -1, t});
        }
        if (items.size() - first_item > 1) {  // on several threads: each leaves partials
          for (size_t i = first_item; i < items.size(); ++i) {
            items[i].w.partial_base = chunk.seg_begin;
            items[i].unit = static_cast<int64_t>(cut.size());
          }
          WorkItem whole = w;
          whole.seg_begin = chunk.seg_begin;
          whole.seg_end = chunk.seg_end;
          cut.push_back({whole, h, static_cast<int64_t>(items.size() - first_item)});
        }
      }
    }
  }
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[cut.size()]);
  int64_t max_slots = 1;
  for (size_t u = 0; u < cut.size(); ++u) {
    pending[u].store(cut[u].items, std::memory_order_relaxed);
    max_slots = std::max(max_slots, cut[u].whole.seg_end - cut[u].whole.seg_begin);
  }
  thread_local std::vector<float> partials;  // [T, H, slots, D + 2]
  if (!cut.empty()) {
    partials.resize(q.size(0) * s.num_heads * max_slots * (s.head_dim + 2));
    in.partials = partials.data();
    in.part_stride_h = max_slots * (s.head_dim + 2);
    in.part_stride_t = s.num_heads * in.part_stride_h;
  }
  std::vector<size_t> starts(threads + 1, items.size());  // thread t's items [starts[t], starts[t + 1])
  for (size_t i = items.size(); i-- > 0;) starts[items[i].thread] = i;
  for (int64_t t = threads - 1; t >= 0; --t) starts[t] = std::min(starts[t], starts[t + 1]);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (size_t i = starts[t0]; i < starts[t1]; ++i) {
      const Item& item = items[i];
      item_fn(item.w, item.kv_head, item.kv_head + 1, s, in, buf);
      if (item.unit >= 0 && pending[item.unit].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_partials(cut[item.unit].whole, cut[item.unit].kv_head, s, in, buf);
    }
  });
}

}  // namespace

namespace pagedllm {

std::string paged_attention_scores() {
#if defined(PAGEDLLM_BF16_DOT)
  if (dot_scores_allowed.load()) return "avx512_bf16";
#endif
#if defined(__AVX512F__)
  return "avx512";
#else
  return "scalar";
#endif
}

void allow_dot_scores(bool allowed) {
#if defined(PAGEDLLM_BF16_DOT)
  dot_scores_allowed.store(allowed);
#else
  (void)allowed;
#endif
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& k_lens,
                     double scale, const c10::optional<at::Tensor>& prefix_out,
                     const c10::optional<at::Tensor>& prefix_lse, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] alike");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1,
              "the head dimension of q, out and the caches must be contiguous");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.size(2) + (int8 ? 4 : 0) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match (an int8 cache's vectors: head_dim + 4 bytes) and num_heads be a "
              "multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() || int8 ||
                   (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "q, out and the caches must share a dtype (or q and out float32, the caches bfloat16; "
              "or the caches int8), got q ", q.scalar_type(), ", caches ", k_cache.scalar_type());
  for (const at::Tensor* t : {&block_tables, &q_starts, &q_lens, &k_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be int64");
  TORCH_CHECK(q_starts.size(0) == q_lens.size(0) && k_lens.size(0) == q_lens.size(0) &&
                  block_tables.size(0) == q_lens.size(0),
              "one block table, q_start, q_len and k_len per row");
  TORCH_CHECK(prefix_out.has_value() == prefix_lse.has_value(),
              "prefix_out and prefix_lse come together");
  if (prefix_out.has_value()) {
    TORCH_CHECK(prefix_out->sizes() == q.sizes() && prefix_out->scalar_type() == q.scalar_type() &&
                    prefix_out->stride(2) == 1,
                "prefix_out must be [T, H, D] like q with a contiguous D");
    TORCH_CHECK(prefix_lse->dim() == 2 && prefix_lse->size(0) == q.size(0) &&
                    prefix_lse->size(1) == q.size(1) && prefix_lse->scalar_type() == at::kFloat &&
                    prefix_lse->stride(1) == 1,
                "prefix_lse must be float32 [T, H] with a contiguous H");
  }
  const float sc = static_cast<float>(scale);
  if (int8) {
    switch (q.scalar_type()) {
      case at::kFloat: run<float, int8_t>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc, prefix_out, prefix_lse, window, static_cast<float>(softcap)); break;
      case at::kBFloat16: run<c10::BFloat16, int8_t>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc, prefix_out, prefix_lse, window, static_cast<float>(softcap)); break;
      default: TORCH_CHECK(false, "paged_attention over an int8 cache takes float32 or bfloat16 queries, got ", q.scalar_type());
    }
    return;
  }
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) {
    run<float, c10::BFloat16>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc,
                              prefix_out, prefix_lse, window, static_cast<float>(softcap));
    return;
  }
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc, prefix_out, prefix_lse, window, static_cast<float>(softcap)); break;
    case at::kBFloat16: run<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc, prefix_out, prefix_lse, window, static_cast<float>(softcap)); break;
    case at::kHalf: run<c10::Half>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc, prefix_out, prefix_lse, window, static_cast<float>(softcap)); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
}


// An int8 cache's head vector from d values x: each x / scale rounded to nearest even, the
// scale max |x| / 127 (0 for a vector of zeros: all its values 0) after them. The same rule
// as attention/kv_quant.py's quantize.
template <typename T>
void quantize_vector(const T* x, int64_t d, char* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float scale = amax / 127.f;
  int8_t* values = reinterpret_cast<int8_t*>(dst);
  for (int64_t i = 0; i < d; ++i) {
    const float r = scale > 0.f ? std::nearbyint(to_float(x[i]) / scale) : 0.f;
    values[i] = static_cast<int8_t>(std::clamp(r, -127.f, 127.f));
  }
  std::memcpy(dst + d, &scale, sizeof(scale));
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, Hkv, D] with a contiguous D");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) + (int8 ? 4 : 0),
              "caches must be contiguous [num_blocks, block_size, Hkv, D] matching k (int8: D + 4)");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k.scalar_type() == k_cache.scalar_type() ||
                   (k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) ||
                   (int8 && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16))),
              "k, v and the caches must share a dtype (or k and v float32, the caches bfloat16; or "
              "k and v float32 or bfloat16, the caches int8), got k ",
              k.scalar_type(), ", caches ", k_cache.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache");
  // fp32 rows into a bf16 cache are rounded to nearest even (as torch rounds); else copied
  const bool narrow = k.scalar_type() != k_cache.scalar_type();
  const int64_t es = k.element_size(), vec = k_cache.size(3) * k_cache.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // one head vector from src to dst
  auto store = [&](char* dst, const char* src) {
    if (int8) {
      if (k.scalar_type() == at::kFloat) quantize_vector(reinterpret_cast<const float*>(src), d, dst);
      else quantize_vector(reinterpret_cast<const c10::BFloat16*>(src), d, dst);
      return;
    }
    if (!narrow) {
      std::memcpy(dst, src, d * es);
      return;
    }
    const float* f = reinterpret_cast<const float*>(src);
    c10::BFloat16* b = reinterpret_cast<c10::BFloat16*>(dst);
    for (int64_t i = 0; i < d; ++i) b[i] = c10::BFloat16(f[i]);
  };
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // -1: not stored
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (slots[t] * heads + h) * vec;
        store(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * es);
        store(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * es);
      }
    }
  });
}

}  // namespace pagedllm
