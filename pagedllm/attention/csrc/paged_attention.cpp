// Paged attention for CPU: every query token of every row attends, causally, to its
// sequence's K/V read in place from the paged cache through the row's block table.
//
// A row computes q_len new tokens after k_len - q_len tokens already cached (decode:
// q_len == 1; a prefill chunk over a cached prefix: q_len > 1). The new tokens' K/V must
// already be stored in the cache. Work is split into (row, kv head, chunk of query tokens)
// items so that the query heads sharing a KV head (GQA) read each cached block once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kQueryChunk = 8;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

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

struct WorkItem {
  int64_t row, q_begin, q_end;  // query tokens [q_begin, q_end) of the row (row-relative)
};

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  int64_t q_stride_t, q_stride_h;              // q and out: [T, H, D]
  int64_t c_stride_b, c_stride_s, c_stride_h;  // caches: [num_blocks, block_size, Hkv, D]
};

// Visits the first num_keys cached tokens of a row block by block (no division per key):
// fn(j, pointer to token j's vector for this kv head).
template <typename T, typename Fn>
inline void for_each_key(const T* cache, const int64_t* table, int64_t num_keys, int64_t kv_head,
                         const Shapes& s, Fn&& fn) {
  for (int64_t b = 0, j = 0; j < num_keys; ++b) {
    const T* base = cache + table[b] * s.c_stride_b + kv_head * s.c_stride_h;
    const int64_t n = std::min(s.block_size, num_keys - j);
    for (int64_t o = 0; o < n; ++o, ++j) fn(j, base + o * s.c_stride_s);
  }
}

// D > 0: the head dim known at compile time (fully unrolled, vectorised loops); D == 0: any.
template <typename T, int64_t D>
void attend_item(const WorkItem& w, int64_t kv_head, const Shapes& s, const T* q, T* out,
                 const T* k_cache, const T* v_cache, const int64_t* tables,
                 const int64_t* q_starts, const int64_t* q_lens, const int64_t* k_lens,
                 float scale, std::vector<float>& buf) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = D > 0 ? D : s.head_dim;
  const int64_t num_q = w.q_end - w.q_begin, rows = num_q * group;
  const int64_t q_len = q_lens[w.row], k_len = k_lens[w.row];
  const int64_t past = k_len - q_len;          // tokens before the row's first new token
  const int64_t num_keys = past + w.q_end;     // keys seen by the chunk's last query
  const int64_t* table = tables + w.row * s.table_width;
  buf.resize(rows * (num_keys + d + 1));
  float* scores = buf.data();                  // [rows, num_keys]
  float* qf = scores + rows * num_keys;        // [rows, d], scaled queries; reused as acc
  float* inv_sum = qf + rows * d;              // [rows]
  // Query r = (token t, head g) sees keys [0, past + q_begin + t].
  for (int64_t t = 0; t < num_q; ++t) {
    const int64_t token = q_starts[w.row] + w.q_begin + t;
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + token * s.q_stride_t + (kv_head * group + g) * s.q_stride_h;
      float* dst = qf + (t * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * scale;
    }
  }
  const int64_t first_unmasked = past + w.q_begin;  // keys every query of the chunk sees
  for_each_key(k_cache, table, num_keys, kv_head, s, [&](int64_t j, const T* kj) {
    const int64_t first_r = j <= first_unmasked ? 0 : (j - first_unmasked) * group;
    for (int64_t r = first_r; r < rows; ++r) scores[r * num_keys + j] = dot<T, D>(kj, qf + r * d, d);
  });
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = first_unmasked + r / group + 1;
    float* sc = scores + r * num_keys;
    float m = -FLT_MAX;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sc[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sc[j] = std::exp(sc[j] - m);
      sum += sc[j];
    }
    inv_sum[r] = 1.f / sum;
  }
  float* acc = qf;
  std::fill(acc, acc + rows * d, 0.f);
  for_each_key(v_cache, table, num_keys, kv_head, s, [&](int64_t j, const T* vj) {
    const int64_t first_r = j <= first_unmasked ? 0 : (j - first_unmasked) * group;
    for (int64_t r = first_r; r < rows; ++r) axpy<T, D>(scores[r * num_keys + j], vj, acc + r * d, d);
  });
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_starts[w.row] + w.q_begin + r / group;
    T* dst = out + token * s.q_stride_t + (kv_head * group + r % group) * s.q_stride_h;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[r * d + i] * inv_sum[r]);
  }
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
         const at::Tensor& k_lens, float scale) {
  const Shapes s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
                 q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  std::vector<WorkItem> items;
  for (int64_t row = 0; row < q_lens.size(0); ++row)
    for (int64_t b = 0; b < ql[row]; b += kQueryChunk)
      items.push_back({row, b, std::min(ql[row], b + kQueryChunk)});
  const int64_t n = static_cast<int64_t>(items.size()) * s.num_kv_heads;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* kl = k_lens.data_ptr<int64_t>();
  auto item_fn = s.head_dim == 64 ? attend_item<T, 64> : s.head_dim == 128 ? attend_item<T, 128>
                                                                          : attend_item<T, 0>;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i)
      item_fn(items[i / s.num_kv_heads], i % s.num_kv_heads, s, qp, op, kp, vp, tp, qs, ql, kl,
              scale, buf);
  });
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& k_lens,
                     double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] alike");
  TORCH_CHECK(q.stride(2) == 1 && out.strides() == q.strides() && k_cache.stride(3) == 1,
              "the head dimension must be contiguous and out laid out like q");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, out and the caches must share a dtype");
  for (const at::Tensor* t : {&block_tables, &q_starts, &q_lens, &k_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be int64");
  TORCH_CHECK(q_starts.size(0) == q_lens.size(0) && k_lens.size(0) == q_lens.size(0) &&
                  block_tables.size(0) == q_lens.size(0),
              "one block table, q_start, q_len and k_len per row");
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc); break;
    case at::kBFloat16: run<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc); break;
    case at::kHalf: run<c10::Half>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, sc); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "out[rows' tokens] = causal attention of q over the paged K/V cache (in place)");
}
