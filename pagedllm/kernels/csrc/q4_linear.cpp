// bf16 rows times a GGUF Q4_1 weight kept quantized: the weight's exact values (those HF
// transformers and llama.cpp dequantize), 5 bits a weight read from memory instead of 16.
//
// A Q4_1 block is 32 consecutive input features of one output: w = d * q + m, q in 0..15,
// d and m fp16. A 16-bit word whose low 4 bits are q, OR 0x4300, is the bf16 of 128 + q
// (exact), so over a block x . w = d * (x . (128 + q)) + (m - 128 d) * sum(x): the dot
// products run on AVX512-BF16 like packed_linear.cpp, and each block's sum is scaled by d
// and corrected in fp32. (Dequantized to bf16 first, d * q + m would be rounded to 8 bits
// of mantissa: this keeps the GGUF's weights as they are.)
//
// Packed once (layers/quantized.py pack_q4_1) as [N/64][K/32][4 groups][320 bytes]: a panel
// of 4 groups of 16 outputs, block after block, so one row streams a panel in order. A
// group's block is 4 runs of 64 bytes, then its 16 outputs' d, then their m (fp16). Word
// 2o + e of run u holds, in its nibbles s = 0..3, output o's element e of the block's input
// pair 4u + s: one 64-byte load gives 4 weight vectors of 16 pairs, in the lane order of a
// dot product, by a shift and a ternary-logic op each. (Widening bytes and looking the
// nibbles up in a table of bf16 0..15 with VPERMW ran no faster.)
//
// Every output is the same sum in the same order whichever rows share the call and however
// the threads split the work: a row's result does not depend on its batch.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include "simd.h"
#endif

namespace {

constexpr int64_t kGroup = 16;       // outputs per group: one vector of fp32 sums
constexpr int64_t kQBlock = 32;      // inputs per Q4_1 block
constexpr int64_t kBlockBytes = 320;  // a group's block: 256 bytes of nibbles, 16 d, 16 m
constexpr int64_t kPanelGroups = 4;   // groups side by side in the packed layout
constexpr int64_t kScaleOffset = 256, kMinOffset = 288;

#if defined(__AVX512BF16__)
// A register tile is kTileRows rows by kTileGroups groups (half a panel); up to kFewRows
// rows, one row by a whole panel. Each (row, group) keeps two sums in a block, of the even
// and of the odd pairs: one row has too few independent sums to hide the dot product's
// latency otherwise (2 chains of 16 per block ran at a third of the speed), and every tile
// sums in the same order.
constexpr int kTileRows = 4;
constexpr int kTileGroups = 2;
constexpr int64_t kFewRows = 3;
constexpr int64_t kChunkRows = 256;  // rows per work item
// One row is too little work per byte for the hardware prefetcher to stay ahead: the panel
// kPrefetchBlocks blocks on is requested as each block starts (30 layers at one row: 3.6 ->
// 2.9-3.0 ms; 2-8 blocks all alike).
constexpr int64_t kPrefetchBlocks = 3;

// One tile: y[0:rows] over NG groups (group g's block b at w + (b * kPanelGroups + g) *
// kBlockBytes), from x and each row's per-block sums xs (row stride ldxs).
template <int MR, int NG>
void tile(int64_t rows, const at::BFloat16* x, int64_t ldx, const float* xs, int64_t ldxs,
          const uint8_t* w, int64_t blocks, at::BFloat16* y, int64_t ldy) {
  if constexpr (MR > 1) {
    if (rows < MR)
      return tile<MR - 1, NG>(rows, x, ldx, xs, ldxs, w, blocks, y, ldy);
  }
  // Word | 0x4300 is the bf16 of 128 + its low 4 bits: the weights as 128 + q, exact.
  const __m512i nibble = _mm512_set1_epi16(0x0F), offset = _mm512_set1_epi16(0x4300);
  __m512 acc[MR][NG];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 part[MR][NG], part_odd[MR][NG];  // x . (128 + q) over the block's even, odd pairs
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) part[m][g] = part_odd[m][g] = _mm512_setzero_ps();
    const uint8_t* wb = w + b * kPanelGroups * kBlockBytes;
    if constexpr (MR == 1 && NG == kPanelGroups) {  // one row: request the panel kPrefetchBlocks on
#pragma GCC unroll 20
      for (int64_t c = 0; c < kPanelGroups * kBlockBytes; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBlocks * kPanelGroups * kBlockBytes + c),
                     _MM_HINT_T0);
    }
    const at::BFloat16* xb = x + b * kQBlock;
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {  // pairs 4u .. 4u + 3 of the block
      __m512bh q[4][NG];
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) {
        const __m512i words = _mm512_loadu_si512(wb + g * kBlockBytes + u * 64);
        // (words & 0xF) | 0x4300 for each nibble in turn
        q[0][g] = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(words, nibble, offset, 0xEA));
        q[1][g] = reinterpret_cast<__m512bh>(
            _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, offset, 0xEA));
        q[2][g] = reinterpret_cast<__m512bh>(
            _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble, offset, 0xEA));
        q[3][g] = reinterpret_cast<__m512bh>(_mm512_or_si512(_mm512_srli_epi16(words, 12), offset));
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          int32_t pair;  // x[m] at pair 4u + k of the block
          std::memcpy(&pair, xb + m * ldx + 8 * u + 2 * k, sizeof(pair));
          const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 16
          for (int g = 0; g < NG; ++g) {  // (the broadcast last: it can be the instruction's)
            if (k % 2) part_odd[m][g] = _mm512_dpbf16_ps(part_odd[m][g], q[k][g], xv);
            else part[m][g] = _mm512_dpbf16_ps(part[m][g], q[k][g], xv);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) part[m][g] = _mm512_add_ps(part[m][g], part_odd[m][g]);
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) {
      const uint8_t* s = wb + g * kBlockBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kScaleOffset)));
      // x . (d q + m) = d x . (128 + q) + (m - 128 d) sum(x)
      const __m512 mn = _mm512_fnmadd_ps(
          d, _mm512_set1_ps(128.f),
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kMinOffset))));
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        acc[m][g] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * ldxs + b]), mn,
                                    _mm512_fmadd_ps(part[m][g], d, acc[m][g]));
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) pagedllm::store16(y + m * ldy + g * kGroup, acc[m][g]);
}

template <int MR, int NG>
void panel_rows(const at::BFloat16* x, int64_t ldx, const float* xs, int64_t ldxs, int64_t M,
                const uint8_t* w, int64_t blocks, at::BFloat16* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += MR)
    tile<MR, NG>(std::min<int64_t>(MR, M - m), x + m * ldx, ldx, xs + m * ldxs, ldxs, w, blocks,
                 y + m * ldy, ldy);
}

void run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), N = y.size(1);
  const int64_t blocks = K / kQBlock, panel_bytes = blocks * kPanelGroups * kBlockBytes;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  // Each row's sum over each block, in fp32 (the m * sum(x) term).
  std::vector<float> sums(M * blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 lo = pagedllm::load16(xp + m * ldx + b * kQBlock);
      const __m512 hi = pagedllm::load16(xp + m * ldx + b * kQBlock + 16);
      sums[m * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  // Work items: (chunk of rows, panel), or with more rows (chunk, half a panel).
  const bool few = M <= kFewRows;
  const int64_t parts = few ? 1 : kPanelGroups / kTileGroups;
  const int64_t items_per_chunk = N / (kGroup * kPanelGroups) * parts;
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, chunks * items_per_chunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = i / items_per_chunk * kChunkRows, item = i % items_per_chunk;
      const int64_t panel = item / parts, part = item % parts;
      const int64_t rows = std::min(kChunkRows, M - m0);
      const at::BFloat16* xr = xp + m0 * ldx;
      const float* xs = sums.data() + m0 * blocks;
      const uint8_t* ws = wp + panel * panel_bytes + part * kTileGroups * kBlockBytes;
      at::BFloat16* ys = yp + m0 * N + (panel * kPanelGroups + part * kTileGroups) * kGroup;
      if (few)
        panel_rows<1, kPanelGroups>(xr, ldx, xs, blocks, rows, ws, blocks, ys, N);
      else
        panel_rows<kTileRows, kTileGroups>(xr, ldx, xs, blocks, rows, ws, blocks, ys, N);
    }
  });
}
#endif

}  // namespace

namespace pagedllm {

at::Tensor q4_1_linear_bf16(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(has_packed_linear_bf16(), "this build has no AVX512-BF16 kernels");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == kPanelGroups && packed.size(3) == kBlockBytes &&
                  packed.is_contiguous(),
              "packed must come from pack_q4_1: uint8 [N/64, K/32, 4, 320]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  x.size(1) == packed.size(1) * kQBlock,
              "x must be bf16 [M, K] with the packed weight's K");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({xc.size(0), packed.size(0) * kPanelGroups * kGroup}, x.options());
#if defined(__AVX512BF16__)
  run(xc, packed, y);
#endif
  return y;
}

}  // namespace pagedllm
