// bf16 linear layers at any batch size on CPUs with AVX512-BF16, from a weight packed once
// for the AVX512-BF16 dot product; on CPUs with AMX the same packing feeds AMX tiles (below,
// run_amx).
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
#include "amx.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

// silu(gate) * up from the fp32 sums of a gate and an up group, rounded as
// packed_linear_bf16 followed by silu_and_mul round (the sums to bf16, SiLU's result to
// bf16; the product is rounded by the store).
inline __m512 silu_times_up(__m512 gate_sum, __m512 up_sum) {
  using pagedllm::round16;
  const __m512 gate = round16<at::BFloat16>(gate_sum);
  const __m512 e = pagedllm::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 silu =
      round16<at::BFloat16>(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return _mm512_mul_ps(silu, round16<at::BFloat16>(up_sum));
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
      for (int g = 0; g < NG / 2; ++g)
        pagedllm::store16(y + m * ldy + g * kGroup, silu_times_up(acc[m][g], acc[m][g + NG / 2]));
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

#if defined(PAGEDLLM_AMX)
// On AMX CPUs the same packing is the right operand of AMX's tile product as it stands: one
// group's next 16 pairs of K ([16][16][2], 1 KB, contiguous) are a 16 x 32 bf16 tile in
// pair order, and 16 rows of x by 32 inputs, read in place, are the left one. A work item
// is a panel of 2 groups (gated: a gate group and its up group) against 32 rows at a time:
// four 16 x 16 fp32 accumulator tiles, two weight tiles and two input tiles, the 8 tile
// registers. Each output's sum runs over K in the same order whatever the batch (rows past
// M are zeros in a padded copy of x), so a row's result does not depend on its batch here
// either; it is not the dot-product path's sum (another order), so a process takes one path
// for all its calls (allow_amx_linear is for tests).
std::atomic<bool> amx_linear_allowed{true};

// How far ahead of the tile loads a work item's first 32 rows prefetch each weight stream
// (the two streams of a panel are a group apart, which the hardware prefetcher follows late):
// in a trial of the same loop with the weight as the left operand, a one-row step over
// Qwen2.5-0.5B's weights took 57 ms with it and 75 without (Xeon, 2 threads).
constexpr int64_t kAmxPrefetch = 4096;
constexpr int64_t kAmxTileBytes = 1024;  // 16 pairs x 16 outputs x 2 bf16

// c = rows (m, m + 16 if kTwo) x groups (a, b), summed over K, as 16 x 16 fp32 tiles in
// that order. Tiles: 0 (a, m), 1 (b, m), 2 (a, m + 16), 3 (b, m + 16); 4, 5 weights; 6, 7 x.
template <bool kTwo>
inline void amx_tiles(const at::BFloat16* x, int64_t ldx, const at::BFloat16* a,
                      const at::BFloat16* b, int64_t K, bool prefetch, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* pa = reinterpret_cast<const char*>(a) + kAmxPrefetch;
  const char* pb = reinterpret_cast<const char*>(b) + kAmxPrefetch;
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    if (prefetch)
      for (int64_t o = 0; o < kAmxTileBytes; o += 64) {
        _mm_prefetch(pa + kb * kAmxTileBytes + o, _MM_HINT_T0);
        _mm_prefetch(pb + kb * kAmxTileBytes + o, _MM_HINT_T0);
      }
    _tile_loadd(4, a + kb * 512, 64);
    _tile_loadd(5, b + kb * 512, 64);
    _tile_loadd(6, x + kb * 32, ldx * 2);
    if constexpr (kTwo) _tile_loadd(7, x + 16 * ldx + kb * 32, ldx * 2);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    if constexpr (kTwo) {
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (kTwo) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// The rows of a pair of accumulator tiles stored as tile() stores its accumulators.
template <bool kGated, typename Out>
inline void amx_store(const float* ca, const float* cb, int64_t rows, Out* y, int64_t ldy,
                      int64_t col_a, int64_t col_b) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 va = _mm512_load_ps(ca + r * 16), vb = _mm512_load_ps(cb + r * 16);
    if constexpr (kGated) {
      pagedllm::store16(y + r * ldy + col_a, silu_times_up(va, vb));
    } else {
      pagedllm::store16(y + r * ldy + col_a, va);
      if (col_b >= 0) pagedllm::store16(y + r * ldy + col_b, vb);
    }
  }
}

// run() on AMX tiles: items (chunk of rows, panel of 2 groups), a chunk's panels adjacent.
// Plain: panel p is groups 2p and 2p + 1 (a last odd group runs beside itself, stored once).
// Gated: panel p is gate group p and its up group.
template <bool kGated, typename Out = at::BFloat16>
void run_amx(const at::Tensor& x_in, const at::Tensor& packed, at::Tensor& y) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = y.size(1);
  // rows as a whole number of 16-row tiles, the rest zeros (tiles read 16 rows)
  const at::Tensor x = M % 16 == 0 ? x_in
      : at::constant_pad_nd(x_in, {0, 0, 0, 16 - M % 16}, 0);
  const int64_t ldx = x.stride(0), groups = packed.size(0);
  const int64_t out_groups = N / kGroup;  // gated: the gate groups
  const int64_t panels = kGated ? out_groups : (out_groups + 1) / 2;
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t group_size = K * kGroup;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  Out* yp = y.data_ptr<Out>();
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    pagedllm::configure_tiles();
    alignas(64) float c[1024];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = i / panels * kChunkRows, p = i % panels;
      const int64_t rows = std::min(kChunkRows, M - m0);
      const int64_t ga = kGated ? p : 2 * p;
      const int64_t gb = kGated ? p + groups / 2 : std::min(2 * p + 1, out_groups - 1);
      const at::BFloat16* a = wp + ga * group_size;
      const at::BFloat16* b = wp + gb * group_size;
      const int64_t col_a = (kGated ? p : ga) * kGroup, col_b = gb != ga ? gb * kGroup : -1;
      for (int64_t m = 0; m < rows; m += 32) {
        const at::BFloat16* xs = xp + (m0 + m) * ldx;
        Out* ys = yp + (m0 + m) * N;
        const int64_t left = rows - m;
        if (left > 16) {
          amx_tiles<true>(xs, ldx, a, b, K, m == 0, c);
          amx_store<kGated>(c, c + 256, 16, ys, N, col_a, col_b);
          amx_store<kGated>(c + 512, c + 768, std::min<int64_t>(16, left - 16), ys + 16 * N, N,
                            col_a, col_b);
        } else {
          amx_tiles<false>(xs, ldx, a, b, K, m == 0, c);
          amx_store<kGated>(c, c + 256, left, ys, N, col_a, col_b);
        }
      }
    }
    _tile_release();
  });
}

// Whether inputs of K features take the AMX path: whole tiles of K (else the dot products).
bool use_amx(int64_t K) {
  return pagedllm::amx_available() && amx_linear_allowed.load() && K % 32 == 0;
}
#else
bool use_amx(int64_t) { return false; }
#endif

}  // namespace

namespace pagedllm {

void allow_amx_linear(bool allowed) {
#if defined(PAGEDLLM_AMX)
  amx_linear_allowed.store(allowed);
#else
  (void)allowed;
#endif
}

bool packed_linear_uses_amx(int64_t k) { return use_amx(k); }

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
#if defined(PAGEDLLM_AMX)
  if (use_amx(xc.size(1))) {
    if (fp32_out)
      run_amx<false, float>(xc, packed, y);
    else
      run_amx<false>(xc, packed, y);
    return y;
  }
#endif
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
#if defined(PAGEDLLM_AMX)
  if (use_amx(xc.size(1))) {
    run_amx<true>(xc, packed, y);
    return y;
  }
#endif
  run<true>(xc, packed, y);
#endif
  return y;
}

}  // namespace pagedllm
