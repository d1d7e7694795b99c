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
// 17.0 at 16, 22.0 vs 27.0 at 32, 41.1 vs 47.0 at 64: 419 GFLOP/s, where the two cores run
// back-to-back dot products with no memory traffic at 450. At 512-2048 rows (prompt chunks)
// 2-5% over oneDNN. packed_gate_up_silu_bf16 runs the same loop over a gate/up projection
// and writes silu(gate) * up.
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
// Plain: a register tile is kTileRows rows by kTileGroups groups (8 x 48 outputs).
constexpr int kTileRows = 8;
constexpr int kTileGroups = 3;
// Gated (gate/up projection with SiLU-and-mul): 6 rows by 2 gate groups and their 2 up
// groups (32 outputs).
constexpr int kGatedTileRows = 6;
constexpr int kGatedTileGroups = 4;
// (The tile loops are unrolled in full: partly unrolled, the accumulators spill to memory;
// a 4 x 6 tile under "unroll 4" ran at a third of the speed.)
// Rows per work item: a chunk of the input stays in L2 while the panels stream past it.
constexpr int64_t kChunkRows = 256;

// x[0:MR] . w over K for NG groups into acc. Group g's packed weight starts at w + g * the
// group's size; for a gated tile the second half of the groups are the up groups of the
// first half's gate groups, `up` elements after them.
template <int MR, int NG, bool kGated>
inline void dot_tile(__m512 (&acc)[MR][NG], const at::BFloat16* x, int64_t ldx,
                     const at::BFloat16* w, int64_t K, int64_t up) {
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  const int64_t pairs = K / 2, group_size = K * kGroup;
  const at::BFloat16* wg[NG];
  for (int g = 0; g < NG; ++g)
    wg[g] = kGated && g >= NG / 2 ? w + up + (g - NG / 2) * group_size : w + g * group_size;
#pragma GCC unroll 2
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NG];
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g)
      wv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wg[g] + p * 2 * kGroup));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x[m][2p], x[m][2p + 1]
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], xv, wv[g]);
    }
  }
}

// One tile of `rows` (1..MR) rows: y[0:rows] = x[0:rows] . w, or for a gated tile
// silu(gate) * up with the roundings of packed_linear_bf16 followed by silu_and_mul (the
// gate and up sums to bf16, SiLU's result to bf16, the product to bf16), so the fused
// kernel's results are those of the two ops bit for bit.
template <int MR, int NG, bool kGated, typename Out>
inline void tile(int64_t rows, const at::BFloat16* x, int64_t ldx, const at::BFloat16* w,
                 int64_t K, int64_t up, Out* y, int64_t ldy) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile<MR - 1, NG, kGated>(rows, x, ldx, w, K, up, y, ldy);
  }
  __m512 acc[MR][NG];
  dot_tile<MR, NG, kGated>(acc, x, ldx, w, K, up);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    if constexpr (kGated) {
#pragma GCC unroll 16
      for (int g = 0; g < NG / 2; ++g) {
        using pagedllm::round16;
        const __m512 gate = round16<at::BFloat16>(acc[m][g]);
        const __m512 e = pagedllm::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
        const __m512 silu =
            round16<at::BFloat16>(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        pagedllm::store16(y + m * ldy + g * kGroup,
                          _mm512_mul_ps(silu, round16<at::BFloat16>(acc[m][g + NG / 2])));
      }
    } else {
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) pagedllm::store16(y + m * ldy + g * kGroup, acc[m][g]);
    }
  }
}

// All M rows against one panel of NG groups, MR rows at a time.
template <int MR, int NG, bool kGated, typename Out>
void panel(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, int64_t K,
           int64_t up, Out* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += MR)
    tile<MR, NG, kGated>(std::min<int64_t>(MR, M - m), x + m * ldx, ldx, w, K, up, y + m * ldy,
                         ldy);
}

// y = x . w (or, gated, silu(gate) * up) over the work items (chunk of rows, panel of
// output groups), a chunk's panels adjacent, split between the threads: decode steps have
// one chunk, and the threads split the weight. y has y.size(1) / 16 output groups, each of
// one weight group (gated: a gate group, and its up group in the weight's second half).
template <bool kGated, typename Out = at::BFloat16>
void run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), N = y.size(1);
  const int64_t groups = N / kGroup;
  const int64_t panel_groups = kGated ? kGatedTileGroups / 2 : kTileGroups;
  const int64_t panels = (groups + panel_groups - 1) / panel_groups;
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t up = kGated ? groups * kGroup * K : 0;  // from a gate group to its up group
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  Out* yp = y.data_ptr<Out>();
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = i / panels * kChunkRows, g0 = i % panels * panel_groups;
      const int64_t rows = std::min(kChunkRows, M - m0);
      const int64_t n = std::min(panel_groups, groups - g0);  // fewer in the last panel
      const at::BFloat16* xs = xp + m0 * ldx;
      const at::BFloat16* ws = wp + g0 * kGroup * K;
      Out* ys = yp + m0 * N + g0 * kGroup;
      if constexpr (kGated) {
        if (n == 2)
          panel<kGatedTileRows, kGatedTileGroups, true>(xs, ldx, rows, ws, K, up, ys, N);
        else
          panel<kGatedTileRows, 2, true>(xs, ldx, rows, ws, K, up, ys, N);
      } else {
        switch (n) {
          case 1: panel<kTileRows, 1, false>(xs, ldx, rows, ws, K, 0, ys, N); break;
          case 2: panel<kTileRows, 2, false>(xs, ldx, rows, ws, K, 0, ys, N); break;
          default: panel<kTileRows, 3, false>(xs, ldx, rows, ws, K, 0, ys, N); break;
        }
      }
    }
  });
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

namespace {

// x's rows contiguous (a copy if not), after checking x and the packed weight.
at::Tensor checked_input(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(has_packed_linear_bf16(), "this build has no AVX512-BF16 packed linear");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 &&
                  packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "packed must come from pack_linear_weight_bf16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == 2 * packed.size(1),
              "x must be bf16 [M, K] with the packed weight's K");
  return x.stride(1) == 1 ? x : x.contiguous();
}

}  // namespace

at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed, bool fp32_out) {
  const at::Tensor xc = checked_input(x, packed);
  at::Tensor y = at::empty({xc.size(0), packed.size(0) * kGroup},
                           x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__)
  if (fp32_out)
    run<false, float>(xc, packed, y);
  else
    run<false>(xc, packed, y);
#endif
  return y;
}

at::Tensor packed_gate_up_silu_bf16(const at::Tensor& x, const at::Tensor& packed) {
  const at::Tensor xc = checked_input(x, packed);
  const int64_t groups = packed.size(0);
  // gate and up each a whole number of groups, or the two ops (same results)
  if (groups % 2 != 0) return silu_and_mul(packed_linear_bf16(xc, packed));
  at::Tensor y = at::empty({xc.size(0), groups / 2 * kGroup}, x.options());
#if defined(__AVX512BF16__)
  run<true>(xc, packed, y);
#endif
  return y;
}

}  // namespace pagedllm
