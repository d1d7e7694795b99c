// Linear layers of decode steps with 5-32 rows in bf16, on AMX tiles, from the plain weight.
//
// Between the weight-streaming kernel of small_linear.cpp (up to 4 rows) and oneDNN's
// matmul on its prepacked copy (which streams the weights at 13-16 GB/s at 5-32 rows here),
// this computes y^T = W x^T: a tile of 16 weight rows x 32 inputs is the left operand, read
// straight from the row-major weight (no second copy), and x^T, rearranged once per call into
// the tiles' pair order, the right one. Two bands of 16 weight rows go at a time when the
// batch fits one tile (16 rows), so that two streams of weight rows are in flight. Over
// SmolLM2's layers: 9.8 vs 13.4 ms at 16 rows, 13 vs 15 ms at 32 (2 threads); oneDNN keeps
// larger batches, where its blocking wins.
#include "amx.h"
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <vector>

namespace pagedllm {

#if defined(PAGEDLLM_AMX)
namespace {

using BF16 = c10::BFloat16;
// Accumulates bands of 16 weight rows (NB bands side by side, MT tiles of 16 input rows)
// over K into tiles 0..NB*MT-1 and stores them to c ([band][tile][16 outputs][16 rows]).
template <int NB, int MT>
void bands(const BF16* w, int64_t K, const uint32_t* xt, float* c) {
  static_assert(NB * MT <= 2, "two accumulators, two weight tiles, one or two input tiles");
  _tile_zero(0);
  if constexpr (NB * MT == 2) _tile_zero(1);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    _tile_loadd(4, w + kb * 32, K * 2);
    if constexpr (NB == 2) _tile_loadd(5, w + 16 * K + kb * 32, K * 2);
    _tile_loadd(6, xt + kb * MT * 256, 64);
    if constexpr (MT == 2) _tile_loadd(7, xt + kb * MT * 256 + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 5, 6);
    if constexpr (MT == 2) _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, c, 64);
  if constexpr (NB * MT == 2) _tile_stored(1, c + 256, 64);
}

}  // namespace
#endif

at::Tensor amx_linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(amx_available(), "the AMX linear is not available here");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "x [M, K] and w [N, K] must agree on K");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "the AMX linear takes bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "x needs contiguous rows, w contiguity");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 32, "the AMX linear takes 1 to 32 rows");
  TORCH_CHECK(x.size(1) % 32 == 0 && w.size(0) % 32 == 0,
              "the AMX linear needs K and N multiples of 32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(PAGEDLLM_AMX)
  const int64_t MT = (M + 15) / 16;
  // x^T in pair order: [K / 32][MT][16 pairs of inputs][16 rows] (32-bit units of two bf16).
  std::vector<uint32_t> xt(K / 32 * MT * 256);
  const BF16* xp = x.data_ptr<BF16>();
  for (int64_t kb = 0; kb < K / 32; ++kb)
    for (int64_t mt = 0; mt < MT; ++mt) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t m = mt * 16 + i;
        r[i] = m < M ? _mm512_loadu_si512(xp + m * x.stride(0) + kb * 32) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int64_t p = 0; p < 16; ++p)
        _mm512_storeu_si512(xt.data() + (kb * MT + mt) * 256 + p * 16, r[p]);
    }
  BF16* yp = y.data_ptr<BF16>();
  const BF16* wp = w.data_ptr<BF16>();
  const int64_t nb = MT == 1 ? 2 : 1;  // weight bands per pass
  at::parallel_for(0, N / (16 * nb), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[2 * 256];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * 16 * nb;
      if (MT == 1)
        bands<2, 1>(wp + n0 * K, K, xt.data(), c);
      else
        bands<1, 2>(wp + n0 * K, K, xt.data(), c);
      for (int64_t t = 0; t < 2; ++t) {  // tile t: outputs n0 + 16t (one band) or rows 16t
        __m512i r[16];
        for (int64_t n = 0; n < 16; ++n) r[n] = _mm512_load_si512(c + t * 256 + n * 16);
        transpose16x16(r);  // r[i]: the 16 outputs of input row i
        const int64_t row0 = MT == 1 ? 0 : 16 * t, col0 = MT == 1 ? n0 + 16 * t : n0;
        for (int64_t i = 0; i < 16 && row0 + i < M; ++i)
          store16(yp + (row0 + i) * N + col0, _mm512_castsi512_ps(r[i]));
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace pagedllm
