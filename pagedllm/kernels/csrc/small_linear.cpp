// Linear layers for decode steps of small batches in bf16.
//
// With a few input rows a linear layer is a matrix-vector product: it must read the whole
// weight once per step, so its speed is the speed at which the weight streams through the
// core. torch's bf16 path reaches about half of what memory gives at one row, and less at
// 2-8 rows. Here each tile of 4 weight rows is read once, sequentially, and multiplied with
// up to 4 input rows at a time in registers by AVX512-BF16 dot products (bf16 pairs
// multiplied exactly, summed in fp32), then rounded to bf16 like torch's own result.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kRowTile = 4;  // weight rows per register tile
constexpr int64_t kInTile = 4;   // input rows per register tile
// Software prefetch this many bytes ahead in each weight row (about two tiles ahead), into
// L2 (T1): the hardware prefetcher alone streamed 14 GB/s over the whole model, prefetches
// into L1 (T0) 24 GB/s where first measured but 20-21 on the 2-core Zen 5, where into L2
// gives 27-28 (SmolLM2's 30 layers of linears at one row: 10.0 -> 7.5 ms, its lm_head
// 2.6 -> 1.8 ms; W2 decode 66 -> 89 tokens/s).
constexpr int64_t kPrefetchBytes = 9216;

inline __m512bh load_bh(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline __m512bh load_bh(const at::BFloat16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// acc[m][n] += x[m] . w[n] over 32 bf16 at k (the first `tail` of them, zero-filled, if
// tail > 0: masked loads, which are slow on the Zen 5 — masking every load made 8 rows
// take 1.7x as long as plain loads, so only the last, partial step of K has them).
template <int MT, int NT>
inline void step(__m512 (&acc)[MT][NT], const at::BFloat16* x, int64_t ldx,
                 const at::BFloat16* w, int64_t K, int64_t k, int64_t tail) {
  const __mmask32 mask = tail > 0 ? (1u << tail) - 1 : ~0u;
  __m512bh wv[NT];
  for (int n = 0; n < NT; ++n) {
    _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k) + kPrefetchBytes, _MM_HINT_T1);
    wv[n] = tail > 0 ? load_bh(w + n * K + k, mask) : load_bh(w + n * K + k);
  }
  for (int m = 0; m < MT; ++m) {
    const __m512bh xv = tail > 0 ? load_bh(x + m * ldx + k, mask) : load_bh(x + m * ldx + k);
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
  }
}

// y[0:MT, 0:NT] = x[0:MT] . w[0:NT] over K, 32 bf16 at a time.
template <int MT, int NT>
inline void tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t K,
                 at::BFloat16* y, int64_t ldy) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step<MT, NT>(acc, x, ldx, w, K, k, 0);
  if (k < K) step<MT, NT>(acc, x, ldx, w, K, k, K - k);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) y[m * ldy + n] = at::BFloat16(_mm512_reduce_add_ps(acc[m][n]));
}

template <int NT>
inline void rows_tile(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w,
                      int64_t K, at::BFloat16* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += kInTile) {
    const at::BFloat16* xm = x + m * ldx;
    at::BFloat16* ym = y + m * ldy;
    switch (std::min(kInTile, M - m)) {
      case 1: tile<1, NT>(xm, ldx, w, K, ym, ldy); break;
      case 2: tile<2, NT>(xm, ldx, w, K, ym, ldy); break;
      case 3: tile<3, NT>(xm, ldx, w, K, ym, ldy); break;
      default: tile<4, NT>(xm, ldx, w, K, ym, ldy); break;
    }
  }
}
#endif

}  // namespace

namespace pagedllm {

bool has_small_linear_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(has_small_linear_bf16(), "this build has no AVX512-BF16 small linear");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "x and w must be bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "x rows and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t ldx = x.stride(0), tiles = N / kRowTile;
  // Split the weight rows between the threads; each chunk streams its rows once.
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rows_tile<kRowTile>(xp, ldx, M, wp + t * kRowTile * K, K, yp + t * kRowTile, N);
  });
  for (int64_t n = tiles * kRowTile; n < N; ++n)  // the last N % 4 rows
    rows_tile<1>(xp, ldx, M, wp + n * K, K, yp + n, N);
#endif
  return y;
}

}  // namespace pagedllm
