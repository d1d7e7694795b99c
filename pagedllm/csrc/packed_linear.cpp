// bf16 linear layers at any batch size on CPUs with AVX512-BF16 (and no AMX), from a weight
// packed once for the AVX512-BF16 dot product.
//
// VDPBF16PS multiplies 16 pairs of bf16 by 16 other pairs and adds each pair's two products
// to one fp32 lane. With the weight packed as [N/16][K/2][16][2] (for each group of 16
// output features, the pairs of input features in order, the group's 16 pairs side by side)
// one 64-byte load is the next pair of K for 16 outputs, and one input pair broadcast to
// every lane multiplies it. A register tile of kTileRows rows by kTileGroups groups
// (8 x 48 outputs: 24 accumulators) loads 3 weight vectors and 8 input pairs for 24 dot
// products, so the multiply unit, not the loads, sets the pace.
//
// Measured on the 2-core Zen 5 against oneDNN on its own packed weight (both threads, SmolLM2's
// 30 layers of linears and its lm_head, 30 different weights of each shape, so streamed from
// memory as in a decode step): 7.9 vs 12.8 ms at 1 row (8.5 for small_linear.cpp), 12.7 vs
// 17.0 at 16, 22.0 vs 27.0 at 32, 41.1 vs 47.0 at 64: 419 GFLOP/s, the dot product's peak
// on these cores (two of them run 450). At 512-2048 rows (prompt chunks) 2-5% over oneDNN.
//
// Every output is the same sum in the same order whichever rows share the call and however
// the threads split the work: a row's result does not depend on its batch.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__)
#include "simd.h"
#endif

namespace {

constexpr int64_t kGroup = 16;  // output features per packed group: one vector of fp32 sums

#if defined(__AVX512BF16__)
constexpr int kTileRows = 8;     // input rows per register tile
constexpr int kTileGroups = 3;   // groups per register tile (a panel of 48 outputs)
// Rows per work item: a chunk of the input stays in L2 while the panels stream past it.
constexpr int64_t kChunkRows = 256;

// y[0:MR, 0:16*NG] = x[0:MR] . w[panel] over K. x rows are ldx apart, y rows ldy apart.
template <int MR, int NG>
inline void tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t K,
                 at::BFloat16* y, int64_t ldy) {
  __m512 acc[MR][NG];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  const int64_t pairs = K / 2, group_size = K * kGroup;
#pragma GCC unroll 2
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NG];
#pragma GCC unroll 3
    for (int g = 0; g < NG; ++g)
      wv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + g * group_size + p * 2 * kGroup));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x[m][2p], x[m][2p + 1]
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 3
      for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], xv, wv[g]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int g = 0; g < NG; ++g) pagedllm::store16(y + m * ldy + g * kGroup, acc[m][g]);
}

// All M rows against one panel of NG groups, kTileRows at a time.
template <int NG>
void panel(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, int64_t K,
           at::BFloat16* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile<kTileRows, NG>(x + m * ldx, ldx, w, K, y + m * ldy, ldy);
  x += m * ldx;
  y += m * ldy;
  switch (M - m) {
    case 1: tile<1, NG>(x, ldx, w, K, y, ldy); break;
    case 2: tile<2, NG>(x, ldx, w, K, y, ldy); break;
    case 3: tile<3, NG>(x, ldx, w, K, y, ldy); break;
    case 4: tile<4, NG>(x, ldx, w, K, y, ldy); break;
    case 5: tile<5, NG>(x, ldx, w, K, y, ldy); break;
    case 6: tile<6, NG>(x, ldx, w, K, y, ldy); break;
    case 7: tile<7, NG>(x, ldx, w, K, y, ldy); break;
    default: break;
  }
}
#endif

}  // namespace

namespace pagedllm {

bool has_packed_linear_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kGroup == 0 && K % 2 == 0 && N > 0 && K > 0,
              "packing needs N a multiple of 16 and K even, got [", N, ", ", K, "]");
  return w.reshape({N / kGroup, kGroup, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(has_packed_linear_bf16(), "this build has no AVX512-BF16 packed linear");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 &&
                  packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "packed must come from pack_linear_weight_bf16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == 2 * packed.size(1),
              "x must be bf16 [M, K] with the packed weight's K");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = packed.size(0) * kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  if (M == 0) return y;
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t ldx = xc.stride(0), groups = N / kGroup;
  const int64_t panels = (groups + kTileGroups - 1) / kTileGroups;
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  // Work items: (chunk of rows, panel of outputs), the panels of a chunk adjacent. Decode
  // steps have one chunk: the threads split the panels (the weight) evenly.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = i / panels * kChunkRows, g0 = i % panels * kTileGroups;
      const int64_t rows = std::min(kChunkRows, M - m0);
      const at::BFloat16* xs = xp + m0 * ldx;
      const at::BFloat16* ws = wp + g0 * kGroup * K;
      at::BFloat16* ys = yp + m0 * N + g0 * kGroup;
      switch (std::min<int64_t>(kTileGroups, groups - g0)) {
        case 1: panel<1>(xs, ldx, rows, ws, K, ys, N); break;
        case 2: panel<2>(xs, ldx, rows, ws, K, ys, N); break;
        default: panel<3>(xs, ldx, rows, ws, K, ys, N); break;
      }
    }
  });
#endif
  return y;
}

}  // namespace pagedllm
