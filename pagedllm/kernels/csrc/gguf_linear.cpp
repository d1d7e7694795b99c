// bf16 rows times a GGUF weight kept quantized (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): the
// weight's exact values (those gguf.quants.dequantize gives), read from memory at about the
// GGUF's own size; activations bf16, sums fp32.
//
// Every type is w = s * q' + c over a scale unit of consecutive inputs of one output, with
// q' an integer that bf16 holds exactly and s, c fp32 computed from the block's fields:
//   Q4_0  q' = 128 + q (q 0..15)  s = d             c = -136 d          (w = d (q - 8))
//   Q4_1  q' = 128 + q            s = d             c = m - 128 d       (w = d q + m)
//   Q8_0  q' = q (int8)           s = d             c = 0
//   Q4_K  q' = 128 + q            s = d sc          c = -128 s - dmin mn (6-bit sc, mn)
//   Q5_K  q' = 128 + q (0..31)    as Q4_K
//   Q6_K  q' = 128 + q (0..63)    s = d sc (int8)   c = -160 s          (w = d sc (q - 32))
// so over a unit x . w = s (x . q') + c sum(x): the dot products run on bf16 (AVX512-BF16
// VDPBF16PS; AVX2 rounds x to 16-bit integers and sums in int32) and each unit's sum is
// scaled and corrected in fp32. A 16-bit word whose low 7 bits are q, OR 0x4300, is the
// bf16 of 128 + q (and as the high half of an fp32, the fp32 of it). d * sc is exact in
// fp32 (11 + 8 bits), not in fp16: the K-quant scales stay the GGUF's integers, one byte
// each, multiplied here. The scale unit is 32 inputs, 16 for Q6_K.
//
// Layout (layers/gguf_packing.py pack_gguf): outputs in groups of 16 (one vector of fp32
// sums), N padded to an even number of groups; groups in panels of 4 (the last may have 2);
// a panel is block after block (32 inputs, 256 for K-quants), so one row streams a panel in
// order. A panel's block is its groups' headers (scales, 16 outputs side by side per field),
// then for each 32 inputs (a unit) each group's quants:
//   header  Q4_0 d[16] fp16 | Q4_1 d[16], m[16] | Q8_0 d[16] |
//           Q4_K/Q5_K d[16], dmin[16] fp16, sc[8][16], mn[8][16] uint8 |
//           Q6_K d[16] fp16, sc[16][16] int8
//   unit    4 runs of 32 16-bit words: run u's word 2o + e holds in its
//           nibbles s = 0..3 the low 4 bits of output o's element e of pair 4u + s;
//           Q5_K then one word vector whose bit j of word 2o + e is bit 4 of pair j's q;
//           Q6_K then two, vector v's bits 2j, 2j + 1 bits 4-5 of pair 8v + j;
//           Q8_0 instead 16 pairs of 32 int8, byte 2o + e of pair p output o's element e.
// The packed size is 1.00-1.03x the GGUF bytes (Q4_K 148/144, Q5_K 180/176). With the
// headers of a block first and every unit 64-byte sized, each quant load is a whole line.
//
// Work: up to 3 rows (2 for Q8_0 on AVX-512), each thread takes whole panels and runs one
// row at a time over all 4 groups; beyond, half panels (2 groups) in 256-row chunks, in
// register tiles of 4 rows by the 2 groups (the last tile of a chunk may have fewer rows)
// that share each unpacked weight vector. Each (row, group) sums a scale unit's even and
// odd pairs in two chains, scales their sum by s and adds c sum(x) in fp32; where c = kFold
// s (Q4_0, Q6_K) the even chain starts at kFold sum(x) instead, one multiply-add less. The
// multiply-adds share the dot product's pipe, so per scale unit they are the kernel's cost
// over the bf16 kernel's: 1/16 (Q8_0, Q4_0), 2/16 (Q4_1, Q4_K, Q5_K), 1/8 (Q6_K's 16-input
// units). A one-row tile unpacks one weight vector (16 outputs' pair 4u + s) at a time (no
// spills), and over a whole panel prefetches the block 4 KiB on (whole blocks) in even
// slices of 4-9 lines, one per run of 8 pairs. Per 64-byte line of quants it runs 4 dot
// products and 4 unpackings of 2 ops (shift, ternary logic; Q5_K, Q6_K: of 4 ops, over
// units of 5 or 6 lines), Q8_0 2 dot products and 2 widenings of 5 ops; per scale unit and
// group ~10 more for s and c. A many-row tile reads its rows' input pairs interleaved (one
// pointer, constant offsets). From a type's kKeepRows rows on, a chunk's first tile also
// stores what it unpacks (q', s, c: 72-80 bytes an input) in a per-thread scratch and the
// chunk's other tiles read it back; below, each tile unpacks again (storing cost more than
// unpacking Q4_0, Q4_1, Q4_K's 2 ops and Q5_K's 4 at any number of rows). The AVX2 path
// keeps the layout but computes in integers (see its section): a 32-byte half of a word
// vector is 8 outputs' pairs of q, multiplied by a row's pair of 16-bit x with VPMADDWD, in
// tiles of 1 row by a whole panel (up to 3 rows) or 1-4 rows by 1 group; a panel's one-row
// tiles and a chunk's first many-row tile prefetch as the AVX-512 one-row tiles.
//
// On CPUs with AMX the K-quants run on AMX-BF16 tiles at every row count (q' and x as the
// AVX-512 path has them, one tile product per scale unit; see its section), and Q4_0, Q4_1
// and Q8_0 on integer tiles with the AVX2 path's sums (from 11 rows; fewer on AVX512-VNNI).
//
// Every output is the same sum in the same order whichever rows share the call and however
// the threads split the work: a row's result does not depend on its batch. The AVX2 path
// sums in another order (its results differ from the AVX-512 path's in the last bits), and
// so do the bf16 tiles.
#include "amx.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#include "simd.h"
#define GGUF_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_AVX2 1
#endif


namespace {

enum class QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int64_t kGroup = 16;       // outputs per group
constexpr int64_t kPanelGroups = 4;  // groups per panel (the last panel may have 2)
constexpr int64_t kUnitInputs = 32;  // inputs per unit: 4 runs of 4 pairs

// One type's layout: a group's block is kHeader bytes of scales and kBlock / 32 units of
// kUnit bytes; kSubs scale units per 32 inputs; kOffset whether c sum(x) is needed; kFold,
// where not 0, that c is kFold s (the AVX-512 path then starts each unit's sum of the even
// pairs at kFold sum(x): s (x . q' + kFold sum(x)), one multiply-add less); kKeepRows, from
// how many rows a chunk's many-row tiles unpack the weight once and keep it (AVX-512; fewer:
// each tile unpacks it again, which is cheaper than storing it where unpacking is 2 ops);
// kFewRows512, up to how many rows the AVX-512 path takes one-row tiles (AVX2: kFewRows).
// Both measured on Zen 5 (docs/benchmarks.md): Q8_0 keeps from 17 rows (from 5 it ran at
// 0.6x between 5 and 8 rows; never: 0.75-0.8x from 64), Q6_K from 128 (from 16: 0.7-0.9x
// at 16 to 64 rows), Q4_0, Q4_1, Q4_K and Q5_K never (keeping ran at 0.8-0.95x wherever
// it was on); Q8_0's one-row tiles stop at 2 rows (a 4-row tile of 3 rows ran 1.2-1.6x
// faster).
constexpr int64_t kNeverKeep = std::numeric_limits<int64_t>::max();
template <QType T>
struct Format;
template <>
struct Format<QType::Q4_0> {
  static constexpr int64_t kBlock = 32, kHeader = 32, kUnit = 256;
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr float kFold = -136.f;
  static constexpr int64_t kKeepRows = kNeverKeep;
  static constexpr int64_t kFewRows512 = 3;
};
template <>
struct Format<QType::Q4_1> {
  static constexpr int64_t kBlock = 32, kHeader = 64, kUnit = 256;
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr float kFold = 0.f;
  static constexpr int64_t kKeepRows = kNeverKeep;
  static constexpr int64_t kFewRows512 = 3;
};
template <>
struct Format<QType::Q8_0> {
  static constexpr int64_t kBlock = 32, kHeader = 32, kUnit = 512;
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = false;
  static constexpr float kFold = 0.f;
  static constexpr int64_t kKeepRows = 17;
  static constexpr int64_t kFewRows512 = 2;
};
template <>
struct Format<QType::Q4_K> {
  static constexpr int64_t kBlock = 256, kHeader = 320, kUnit = 256;
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr float kFold = 0.f;
  static constexpr int64_t kKeepRows = kNeverKeep;
  static constexpr int64_t kFewRows512 = 3;
};
template <>
struct Format<QType::Q5_K> {
  static constexpr int64_t kBlock = 256, kHeader = 320, kUnit = 320;
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr float kFold = 0.f;
  static constexpr int64_t kKeepRows = kNeverKeep;
  static constexpr int64_t kFewRows512 = 3;
};
template <>
struct Format<QType::Q6_K> {
  static constexpr int64_t kBlock = 256, kHeader = 288, kUnit = 384;
  static constexpr int kSubs = 2;
  static constexpr bool kOffset = true;
  static constexpr float kFold = -160.f;
  static constexpr int64_t kKeepRows = 128;
  static constexpr int64_t kFewRows512 = 3;
};

template <QType T>
constexpr int64_t kUnits = Format<T>::kBlock / kUnitInputs;
template <QType T>  // whether the AVX-512 path adds c sum(x) to each unit's sum
constexpr bool kAddOffset512 = Format<T>::kOffset && Format<T>::kFold == 0.f;
template <QType T>
constexpr int64_t kGroupBlock = Format<T>::kHeader + kUnits<T> * Format<T>::kUnit;

// Where a type's packed weight of n outputs puts its panels and blocks.
struct Shape {
  int64_t blocks, groups, panels, panel_bytes, block_bytes;  // (of a full panel)
  int64_t groups_in(int64_t panel) const {
    return std::min(kPanelGroups, groups - panel * kPanelGroups);
  }
};

template <QType T>
Shape shape_of(int64_t n, int64_t k) {
  Shape s;
  s.blocks = k / Format<T>::kBlock;
  s.groups = (n + 2 * kGroup - 1) / (2 * kGroup) * 2;
  s.panels = (s.groups + kPanelGroups - 1) / kPanelGroups;
  s.block_bytes = kPanelGroups * kGroupBlock<T>;
  s.panel_bytes = s.blocks * s.block_bytes;
  return s;
}

// One row is too little work per byte for the hardware prefetcher to stay ahead: a one-row
// tile over a whole panel requests the block at least kPrefetchBytes of the panel on (whole
// blocks) in even slices, one as it starts each run of 8 pairs (4 slices a unit, 4-9 lines
// each). Requesting a block's headers or a whole unit at once (up to 36 lines) lost
// prefetches: the K-quants and Q8_0 streamed at 2/3 of Q4_0's rate from memory while
// running as fast from L2. (Multi-row tiles prefetching ran 10-20% slower at 4 rows.)
constexpr int64_t kPrefetchBytes = 4096;
// Slice `step` of `steps` of a block of `bytes` at p: the lines that start in it.
inline void prefetch_slice(const uint8_t* p, int64_t bytes, int step, int steps) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = (base + bytes * (step + 1) / steps) & ~uintptr_t{63};
  for (uintptr_t a = (base + bytes * step / steps) & ~uintptr_t{63}; a < end; a += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}
template <QType T>
int64_t prefetch_distance(int64_t G) {
  const int64_t block = G * kGroupBlock<T>;
  return (kPrefetchBytes + block - 1) / block * block;
}

// A call's work items: chunks of rows, each by every panel (whole) or half panel (2 groups),
// a chunk's items adjacent.
struct WorkItems {
  const Shape& sh;
  int64_t M, n, chunk_rows;
  bool whole;
  int64_t per_chunk() const { return whole ? sh.panels : sh.groups / 2; }
  int64_t count() const { return (M + chunk_rows - 1) / chunk_rows * per_chunk(); }
  struct Item {
    int64_t m0, rows;          // the chunk's first row, its rows
    int64_t panel, G, g0, NG;  // the panel, its groups, the item's first group and groups
    int64_t col0, cols;        // the item's first output, its outputs (less N's padding)
  };
  Item operator[](int64_t i) const {
    Item t;
    t.m0 = i / per_chunk() * chunk_rows;
    t.rows = std::min(chunk_rows, M - t.m0);
    const int64_t item = i % per_chunk();
    t.panel = whole ? item : item / 2;
    t.G = sh.groups_in(t.panel);
    t.g0 = whole ? 0 : item % 2 * 2;
    t.NG = whole ? t.G : 2;
    t.col0 = (t.panel * kPanelGroups + t.g0) * kGroup;
    t.cols = std::min(t.NG * kGroup, n - t.col0);
    return t;
  }
};

constexpr int64_t kChunkRows = 256;  // rows per work item
constexpr int64_t kFewRows = 3;      // AVX2: up to this many, one-row tiles of a whole panel
constexpr int kTileRows = 4;         // rows of a many-row tile (AVX-512)
constexpr int64_t kVnniTileRows = 5;  // AMX CPUs below kAmxMinRows: rows512i's most rows

// y[:, :cols] = v (a tile's fp32 sums, 16 per group) as Out.
template <typename Out>
inline void store_row(Out* y, const float* v, int64_t cols) {
  int64_t j = 0;
#if defined(GGUF_AVX512)
  for (; j + kGroup <= cols; j += kGroup) pagedllm::store16(y + j, _mm512_loadu_ps(v + j));
#endif
  for (; j < cols; ++j) y[j] = static_cast<Out>(v[j]);  // (c10's rounding, as store16's)
}

// The AVX2 path's s and c2 (w = s q + c2) of a scale unit `sub` from a group's header, on
// vectors of L's outputs (Lanes8 for scales256, Lanes16 for the AVX-512 paths that end each
// unit as the AVX2 path does): one formula, so the two widths give the same bits.
template <QType T, typename L>
inline void avx2_scales(const L& lanes, const uint8_t* header, int sub, typename L::Vec& s,
                        typename L::Vec& c2) {
  constexpr bool kSigned = T == QType::Q6_K;  // Q6_K's sub-block scales are int8
  if constexpr (T == QType::Q4_0) {
    s = lanes.fp16(header);
    c2 = L::mul(s, L::set1(-8.f));
  } else if constexpr (T == QType::Q4_1) {
    s = lanes.fp16(header);
    c2 = lanes.fp16(header + 32);
  } else if constexpr (T == QType::Q8_0) {
    s = lanes.fp16(header);
    c2 = L::zero();
  } else if constexpr (T == QType::Q6_K) {
    s = L::mul(lanes.fp16(header), lanes.template bytes<kSigned>(header + 32 + 16 * sub));
    c2 = L::mul(s, L::set1(-32.f));
  } else {
    s = L::mul(lanes.fp16(header), lanes.template bytes<kSigned>(header + 64 + 16 * sub));
    c2 = L::sub(L::zero(), L::mul(lanes.fp16(header + 32),
                                  lanes.template bytes<kSigned>(header + 192 + 16 * sub)));
  }
}

// ---- AVX-512 (AVX512-BF16) -------------------------------------------------------------
#if defined(GGUF_AVX512)
// A group's 16 outputs of a header field: fp16 values (32 bytes) or bytes (16) at p, as fp32.
struct Lanes16 {
  using Vec = __m512;
  static Vec fp16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <bool kSigned>
  static Vec bytes(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec set1(float v) { return _mm512_set1_ps(v); }
  static Vec zero() { return _mm512_setzero_ps(); }
};

// Bits `from`.. of each 16-bit word moved to bit 4 (the other bits are masked off after).
inline __m512i bits_to_4(__m512i v, int from) {
  return from >= 4 ? _mm512_srli_epi16(v, from - 4) : _mm512_slli_epi16(v, 4 - from);
}

// q of pair 4u + s of a group's unit (a nibble type: not Q8_0), 16 outputs' pairs as 16-bit
// words (word 2o + e: output o's element e), each OR base.
template <QType T>
inline __m512i nibble_words512(const uint8_t* unit, int u, int s, __m512i base) {
  const __m512i words = _mm512_loadu_si512(unit + u * 64);
  __m512i high = base;  // base | the high bits of q, in place
  if constexpr (T == QType::Q5_K) {
    const __m512i plane_bits = _mm512_loadu_si512(unit + 256);
    high = _mm512_ternarylogic_epi32(bits_to_4(plane_bits, 4 * u + s), _mm512_set1_epi16(0x10),
                                     base, 0xEA);
  } else if constexpr (T == QType::Q6_K) {
    const __m512i plane_bits = _mm512_loadu_si512(unit + 256 + u / 2 * 64);
    high = _mm512_ternarylogic_epi32(bits_to_4(plane_bits, 2 * (4 * (u % 2) + s)),
                                     _mm512_set1_epi16(0x30), base, 0xEA);
  }
  // (nibble s & 0xF) | high
  return _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4 * s), _mm512_set1_epi16(0x0F), high,
                                   0xEA);
}

// q' of pair 4u + s of a group's unit, 16 pairs. (Q8_0 as two nibble planes, 128 + lo and
// 128 + hi, each summed in its chain and combined 16 hi + lo, ran as fast at one row as the
// int8 widening below, once the prefetches were spread, and took 1.3x as long from 16 rows
// on: twice the dot products.)
template <QType T>
inline __m512bh decode512(const uint8_t* unit, int u, int s) {
  if constexpr (T == QType::Q8_0) {
    const uint8_t* p = unit + (4 * u + s) * 32;
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 128
  }
  // 0x4300 | q: the bf16 of 128 + q
  return reinterpret_cast<__m512bh>(nibble_words512<T>(unit, u, s, _mm512_set1_epi16(0x4300)));
}

// A group's s and c for scale unit `sub` of its block (header: the group's scales).
template <QType T>
inline void scales512(const uint8_t* header, int sub, __m512& s, __m512& c) {
  auto fp16 = [&](int64_t at) { return Lanes16::fp16(header + at); };
  auto bytes = [&](int64_t at) { return Lanes16::bytes<T == QType::Q6_K>(header + at); };
  if constexpr (T == QType::Q4_0) {
    s = fp16(0);
    c = _mm512_mul_ps(s, _mm512_set1_ps(-136.f));
  } else if constexpr (T == QType::Q4_1) {
    s = fp16(0);
    c = _mm512_fnmadd_ps(s, _mm512_set1_ps(128.f), fp16(32));
  } else if constexpr (T == QType::Q8_0) {
    s = fp16(0);
    c = _mm512_setzero_ps();
  } else if constexpr (T == QType::Q6_K) {
    s = _mm512_mul_ps(fp16(0), bytes(32 + 16 * sub));
    c = _mm512_mul_ps(s, _mm512_set1_ps(-160.f));
  } else {  // Q4_K, Q5_K
    s = _mm512_mul_ps(fp16(0), bytes(64 + 16 * sub));
    c = _mm512_fnmsub_ps(s, _mm512_set1_ps(128.f), _mm512_mul_ps(fp16(32), bytes(192 + 16 * sub)));
  }
}

// One tile: out[0:MR][NG * 16] = x[0:MR] . w over groups g0 .. g0 + NG - 1 of a panel
// of G groups starting at w; xs: each row's sum over each scale unit (times kFold where the
// type has one; row stride ldxs). Taken for one row by a whole panel (MR = 1, NG = G): the
// many-row tiles are rows_tile512.
// Each (row, group) keeps two sums in a scale unit, of the even and of the odd pairs: one
// row has too few independent sums to hide the dot product's latency otherwise.
template <QType T, int MR, int NG>
void tile512(const at::BFloat16* x, int64_t ldx, const float* xs, int64_t ldxs,
             const uint8_t* w, int64_t G, int64_t g0, int64_t blocks, float* out) {
  using F = Format<T>;
  constexpr int kRuns = 4 / F::kSubs;  // runs per scale unit
  const int64_t ahead = prefetch_distance<T>(G);
  __m512 acc[MR][NG];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * G * kGroupBlock<T>;
    for (int i = 0; i < kUnits<T>; ++i) {
      const uint8_t* units = blk + G * F::kHeader + (i * G + g0) * F::kUnit;
      const at::BFloat16* xu = x + b * F::kBlock + i * kUnitInputs;
#pragma GCC unroll 2
      for (int h = 0; h < F::kSubs; ++h) {
        __m512 part[MR][NG], part_odd[MR][NG];  // x . q' over the even, odd pairs
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
          for (int g = 0; g < NG; ++g) {
            const float x_sum = xs[m * ldxs + b * kUnits<T> * F::kSubs + i * F::kSubs + h];
            part[m][g] = F::kFold != 0.f ? _mm512_set1_ps(x_sum) : _mm512_setzero_ps();
            part_odd[m][g] = _mm512_setzero_ps();
          }
#pragma GCC unroll 4
        for (int u = h * kRuns; u < (h + 1) * kRuns; ++u) {
          if (MR == 1 && NG == G)
            prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            // one weight vector at a time, used by every row as it is made: few registers
            __m512 xv[MR];  // x[m] at pair 4u + s of the unit
#pragma GCC unroll 16
            for (int m = 0; m < MR; ++m) {
              int32_t pair;
              std::memcpy(&pair, xu + m * ldx + 8 * u + 2 * s, sizeof(pair));
              xv[m] = _mm512_castsi512_ps(_mm512_set1_epi32(pair));
            }
#pragma GCC unroll 16
            for (int g = 0; g < NG; ++g) {
              const __m512bh q = decode512<T>(units + g * F::kUnit, u, s);
#pragma GCC unroll 16
              for (int m = 0; m < MR; ++m) {
                const __m512bh xb = reinterpret_cast<__m512bh>(xv[m]);
                if (s % 2) part_odd[m][g] = _mm512_dpbf16_ps(part_odd[m][g], q, xb);
                else part[m][g] = _mm512_dpbf16_ps(part[m][g], q, xb);
              }
            }
          }
        }
        const int sub = i * F::kSubs + h;
#pragma GCC unroll 16
        for (int g = 0; g < NG; ++g) {
          __m512 s, c;
          scales512<T>(blk + (g0 + g) * F::kHeader, sub, s, c);
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) {
            const __m512 sum = _mm512_add_ps(part[m][g], part_odd[m][g]);
            acc[m][g] = _mm512_fmadd_ps(sum, s, acc[m][g]);
            if constexpr (kAddOffset512<T>)
              acc[m][g] = _mm512_fmadd_ps(
                  _mm512_set1_ps(xs[m * ldxs + b * kUnits<T> * F::kSubs + sub]), c, acc[m][g]);
          }
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(out + m * NG * kGroup + g * kGroup, acc[m][g]);
}

// x's 16 values at p as fp32, denormals as zeros: as VDPBF16PS and TDPBF16PS read them, so
// that a scale unit's c sum(x) is over the inputs its dot products saw.
inline __m512 load16_daz(const at::BFloat16* p) {
  const __m512 v = pagedllm::load16(p);
  return _mm512_maskz_mov_ps(
      _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(std::numeric_limits<float>::min()),
                         _CMP_NLT_UQ),
      v);
}

// Each row's sum over each scale unit of `width` inputs (denormals as zeros), times `factor`.
void unit_sums512(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t width,
                  float factor, float* sums) {
  const int64_t per_row = K / width;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < per_row; ++j) {
      const at::BFloat16* p = x + m * ldx + j * width;
      __m512 v = load16_daz(p);
      if (width == 32) v = _mm512_add_ps(v, load16_daz(p + 16));
      sums[m * per_row + j] = _mm512_reduce_add_ps(v) * factor;
    }
}

// Many rows: from kKeepRows rows on, the first tile of a work item (a chunk of rows, 2
// groups) unpacks the groups' weights as it goes and keeps them in a per-thread scratch,
// the item's other tiles read them back: each weight vector and each scale unit's s and c
// are made once a chunk, not once a tile. Per scale unit the scratch holds s for the 2
// groups, c for the 2, then q' pair after pair, the 2 groups side by side: all 64-byte
// vectors.
template <QType T>
constexpr int kUnitPairs = kUnitInputs / 2 / Format<T>::kSubs;  // pairs per scale unit
template <QType T>
constexpr int64_t kScratchVectors = 4 + 2 * kUnitPairs<T>;  // per scale unit

// A tile of MR rows by groups g0, g0 + 1 (tile512's sums in its order) over the weight
// unpacked from the panel at w into scratch (kUnpack; kKeep: and kept there) or read back
// from it. xt: the rows' input pairs interleaved, pair p of row m at xt[p * MR + m].
template <QType T, int MR, bool kUnpack, bool kKeep>
void rows_tile512(const int32_t* xt, const float* xs, int64_t ldxs, const uint8_t* w, int64_t G,
                  int64_t g0, int64_t blocks, __m512i* scratch, float* out) {
  using F = Format<T>;
  constexpr int NG = 2, P = kUnitPairs<T>, kRuns = 4 / F::kSubs;
  __m512 acc[MR][NG];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  __m512i* q = scratch;
  int64_t su = 0;  // scale unit
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * G * kGroupBlock<T>;
    for (int i = 0; i < kUnits<T>; ++i) {
      const uint8_t* units = blk + G * F::kHeader + (i * G + g0) * F::kUnit;
#pragma GCC unroll 2
      for (int h = 0; h < F::kSubs; ++h, ++su, q += kScratchVectors<T>) {
        const int32_t* xu = xt + su * P * MR;
        __m512 part[MR][NG], part_odd[MR][NG];  // x . q' over the even, odd pairs
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
          for (int g = 0; g < NG; ++g) {
            part[m][g] = F::kFold != 0.f ? _mm512_set1_ps(xs[m * ldxs + su]) : _mm512_setzero_ps();
            part_odd[m][g] = _mm512_setzero_ps();
          }
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 2
          for (int g = 0; g < NG; ++g) {
            __m512bh wv;
            if constexpr (kUnpack) {
              wv = decode512<T>(units + g * F::kUnit, h * kRuns + p / 4, p % 4);
              if constexpr (kKeep) _mm512_store_si512(q + 4 + 2 * p + g, reinterpret_cast<__m512i>(wv));
            } else {
              wv = reinterpret_cast<__m512bh>(_mm512_load_si512(q + 4 + 2 * p + g));
            }
#pragma GCC unroll 16
            for (int m = 0; m < MR; ++m) {
              const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xu[p * MR + m]));
              if (p % 2) part_odd[m][g] = _mm512_dpbf16_ps(part_odd[m][g], wv, xb);
              else part[m][g] = _mm512_dpbf16_ps(part[m][g], wv, xb);
            }
          }
        }
        float* scales = reinterpret_cast<float*>(q);  // s[2], c[2]
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          __m512 s, c;
          if constexpr (kUnpack) {
            scales512<T>(blk + (g0 + g) * F::kHeader, i * F::kSubs + h, s, c);
            if constexpr (kKeep) {
              _mm512_store_ps(scales + g * kGroup, s);
              if constexpr (kAddOffset512<T>) _mm512_store_ps(scales + (NG + g) * kGroup, c);
            }
          } else {
            s = _mm512_load_ps(scales + g * kGroup);
            if constexpr (kAddOffset512<T>) c = _mm512_load_ps(scales + (NG + g) * kGroup);
          }
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) {
            acc[m][g] = _mm512_fmadd_ps(_mm512_add_ps(part[m][g], part_odd[m][g]), s, acc[m][g]);
            if constexpr (kAddOffset512<T>)
              acc[m][g] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * ldxs + su]), c, acc[m][g]);
          }
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(out + (m * NG + g) * kGroup, acc[m][g]);
}

// rows_tile512 for `rows` (1 .. MR) rows.
template <QType T, int MR, bool kUnpack, bool kKeep>
void rows512(int64_t rows, const int32_t* xt, const float* xs, int64_t ldxs, const uint8_t* w,
             int64_t G, int64_t g0, int64_t blocks, __m512i* scratch, float* out) {
  if constexpr (MR > 1) {
    if (rows < MR)
      return rows512<T, MR - 1, kUnpack, kKeep>(rows, xt, xs, ldxs, w, G, g0, blocks, scratch, out);
  }
  rows_tile512<T, MR, kUnpack, kKeep>(xt, xs, ldxs, w, G, g0, blocks, scratch, out);
}

// x's input pairs for the many-row tiles: each tile of kTileRows rows (from row 0 on; the
// last may have fewer) interleaved, its pair p of row j at xt[m * K / 2 + p * r + j] (m its
// first row, r its rows).
void interleave_rows512(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int32_t* xt) {
  for (int64_t m = 0; m < M; m += kTileRows) {
    const int64_t r = std::min<int64_t>(kTileRows, M - m);
    for (int64_t j = 0; j < r; ++j)
      for (int64_t p = 0; p < K / 2; ++p)
        std::memcpy(xt + m * K / 2 + p * r + j, x + (m + j) * ldx + 2 * p, sizeof(int32_t));
  }
}
#endif  // GGUF_AVX512


// ---- AVX2 + FMA + F16C -----------------------------------------------------------------
// Integer dot products: x is rounded to 16-bit integers per scale unit (x ~ xs xq, xs a
// power of two: x's elements within 2^7 of the unit's largest are exact, the rest err by at
// most 2^-16 of it), q is the quant itself (not q' = 128 + q), and VPMADDWD multiplies a
// word vector's 8 outputs' pairs by the row's pair and adds each output's two products:
// 16 multiply-adds in one instruction, summed exactly in int32 over a unit. Per unit
// x . w = s xs (xq . q) + c2 xs sum(xq), with c2 = c + 128 s the weight at q = 0.
#if defined(GGUF_AVX2)
inline __m256i bits_to_4_avx2(__m256i v, int from) {
  return from >= 4 ? _mm256_srli_epi16(v, from - 4) : _mm256_slli_epi16(v, 4 - from);
}

// q of pair 4u + s of a group's unit, outputs 8 half .. 8 half + 7, as 16-bit integers
// (word 2o + e: output o's element e).
template <QType T>
inline __m256i quants256(const uint8_t* unit, int u, int s, int half) {
  if constexpr (T == QType::Q8_0) {
    return _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + (4 * u + s) * 32 + 16 * half)));
  } else {
    const __m256i words =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + u * 64 + half * 32));
    __m256i q = s == 3 ? _mm256_srli_epi16(words, 12)
                       : _mm256_and_si256(_mm256_srli_epi16(words, 4 * s), _mm256_set1_epi16(0x0F));
    if constexpr (T == QType::Q5_K) {
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 256 + half * 32));
      q = _mm256_or_si256(q, _mm256_and_si256(bits_to_4_avx2(plane, 4 * u + s), _mm256_set1_epi16(0x10)));
    } else if constexpr (T == QType::Q6_K) {
      const __m256i plane = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(unit + 256 + u / 2 * 64 + half * 32));
      q = _mm256_or_si256(q, _mm256_and_si256(bits_to_4_avx2(plane, 2 * (4 * (u % 2) + s)),
                                              _mm256_set1_epi16(0x30)));
    }
    return q;
  }
}

// A group's outputs 8 half .. 8 half + 7 of a header field: fp16 values (16 of the field's
// 32 bytes) or bytes (8 of 16) at p, as fp32.
struct Lanes8 {
  using Vec = __m256;
  int half;
  Vec fp16(const uint8_t* p) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
  }
  template <bool kSigned>
  Vec bytes(const uint8_t* p) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half));
    return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec set1(float v) { return _mm256_set1_ps(v); }
  static Vec zero() { return _mm256_setzero_ps(); }
};

// A scale unit's s and c2 (w = s q + c2) for outputs 8 half .. 8 half + 7 of a group.
template <QType T>
inline void scales256(const uint8_t* header, int sub, int half, __m256& s, __m256& c2) {
  avx2_scales<T>(Lanes8{half}, header, sub, s, c2);
}

// A scale unit of x whose largest |x| is top that rounds to nothing: all zeros, or holding
// an inf or a NaN (not finite: a NaN scale, so that its outputs are NaN). Writes its zero
// integers, scale and sum and returns true; otherwise writes nothing.
inline bool rounds_to_nothing(float top, bool finite, int16_t* q, int64_t width, float& xs,
                              float& xsum) {
  if (top != 0.f && finite) return false;
  std::memset(q, 0, width * sizeof(int16_t));
  xs = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
  xsum = 0.f;
  return true;
}

#if defined(GGUF_AVX512)
// 2^e as a float: its bits where e is a normal exponent, else std::ldexp (0, a denormal or inf).
inline float power_of_two(int e) {
  if (e < -126 || e > 127) return std::ldexp(1.f, e);
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// quantize_rows256's results bit for bit, a scale unit (16 or 32 inputs) in one or two
// 512-bit vectors: the same fp32 values, the same power of two (std::frexp's exponent read
// from the bits of a normal top), the same rounding (MXCSR's) and saturation, the same sum.
void quantize_rows512(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t width,
                      int16_t* xq, float* xs, float* xsum) {
  const int64_t per_row = K / width, halves = width / 16;
  const __m512i lowest = _mm512_set1_epi32(-32768), highest = _mm512_set1_epi32(32767);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < per_row; ++j) {
      const at::BFloat16* p = x + m * ldx + j * width;
      __m512 f[2];
      __m512 big = _mm512_setzero_ps();
      __mmask16 nan = 0;
      for (int64_t h = 0; h < halves; ++h) {
        f[h] = pagedllm::load16(p + 16 * h);
        big = _mm512_max_ps(big, _mm512_abs_ps(f[h]));
        nan |= _mm512_cmp_ps_mask(f[h], f[h], _CMP_UNORD_Q);
      }
      const float top = _mm512_reduce_max_ps(big);
      const bool finite = nan == 0 && std::isfinite(top);
      int16_t* q = xq + m * K + j * width;
      if (rounds_to_nothing(top, finite, q, width, xs[m * per_row + j], xsum[m * per_row + j]))
        continue;
      uint32_t bits;
      std::memcpy(&bits, &top, sizeof(bits));
      int exponent = static_cast<int>(bits >> 23) - 126;  // std::frexp's, for a normal top
      if ((bits >> 23) == 0) std::frexp(top, &exponent);
      const __m512 up = _mm512_set1_ps(power_of_two(15 - exponent));
      __m512i total = _mm512_setzero_si512();
      for (int64_t h = 0; h < halves; ++h) {
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(f[h], up));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h), _mm512_cvtsepi32_epi16(r));
        total = _mm512_add_epi32(total, _mm512_min_epi32(_mm512_max_epi32(r, lowest), highest));
      }
      xs[m * per_row + j] = power_of_two(exponent - 15);
      xsum[m * per_row + j] = static_cast<float>(_mm512_reduce_add_epi32(total)) * xs[m * per_row + j];
    }
}
#endif

// Rows x, rounded per scale unit: xq (16-bit, row stride K), xs (each unit's power of
// two) and xsum (xs sum(xq)), per_row = K / width units a row. A unit holding an inf or a
// NaN gets a NaN scale, so its outputs are NaN as they would be in floating point. The AVX2
// path's sums on AVX512-VNNI and AMX take quantize_rows512, the same bits 2.4x as fast; the
// AVX2 path itself takes this one even where the CPU has AVX-512 (a test forcing it), so
// that the tests run it on AVX-512 machines as well.
void quantize_rows256(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t width,
                      int16_t* xq, float* xs, float* xsum) {
  const int64_t per_row = K / width;
  alignas(32) float v[32];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < per_row; ++j) {
      const at::BFloat16* p = x + m * ldx + j * width;
      __m256 big = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int64_t e = 0; e < width; e += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + e));
        const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        _mm256_store_ps(v + e, f);
        big = _mm256_max_ps(big, _mm256_andnot_ps(_mm256_set1_ps(-0.f), f));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
      }
      __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
      top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
      const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 1)));
      const bool finite = _mm256_movemask_ps(nan) == 0 && std::isfinite(top);
      int16_t* q = xq + m * K + j * width;
      if (rounds_to_nothing(top, finite, q, width, xs[m * per_row + j], xsum[m * per_row + j]))
        continue;
      int exponent;
      std::frexp(top, &exponent);  // top < 2^exponent: |x| / 2^(exponent - 15) < 2^15
      const float up = std::ldexp(1.f, 15 - exponent);
      int32_t total = 0;
      for (int64_t e = 0; e < width; e += 8) {
        const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + e), _mm256_set1_ps(up)));
        const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + e), packed);
        for (int i = 0; i < 8; ++i) total += q[e + i];
      }
      xs[m * per_row + j] = std::ldexp(1.f, exponent - 15);
      xsum[m * per_row + j] = static_cast<float>(total) * xs[m * per_row + j];
    }
}

// A scale unit's int32 sum (part) of 8 outputs added to their fp32 total: s xs part + c2
// xsum (xs, xsum: the row's unit scale and sum), in every tile's order.
template <QType T>
inline __m256 add_unit256(__m256 acc, __m256i part, __m256 s, __m256 c2, float xs, float xsum) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part), _mm256_mul_ps(s, _mm256_set1_ps(xs)), acc);
  if constexpr (T != QType::Q8_0) acc = _mm256_fmadd_ps(_mm256_set1_ps(xsum), c2, acc);
  return acc;
}

// The sums of one row (xq, its unit scales xs and sums xsum) by the NG groups of a panel of
// G groups, whole: each (group, half) sums a scale unit's pairs in order in int32, then adds
// s xs times that sum and c2 xsum to its fp32 total. The tile prefetches the panel ahead.
template <QType T, int NG>
void row256(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, int64_t G,
            int64_t blocks, float* out) {
  using F = Format<T>;
  constexpr int kRuns = 4 / F::kSubs;
  const int64_t ahead = prefetch_distance<T>(G);
  __m256 acc[NG][2];
  for (int g = 0; g < NG; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * G * kGroupBlock<T>;
    for (int i = 0; i < kUnits<T>; ++i) {
      const uint8_t* units = blk + G * F::kHeader + i * G * F::kUnit;
      const int16_t* xu = xq + b * F::kBlock + i * kUnitInputs;
#pragma GCC unroll 2
      for (int h = 0; h < F::kSubs; ++h) {
        __m256i part[NG][2];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) part[g][0] = part[g][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int u = h * kRuns; u < (h + 1) * kRuns; ++u) {
          prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            int32_t xp;
            std::memcpy(&xp, xu + 8 * u + 2 * s, sizeof(xp));
            const __m256i pair = _mm256_set1_epi32(xp);
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g)
#pragma GCC unroll 2
              for (int half = 0; half < 2; ++half) {
                const __m256i q = quants256<T>(units + g * F::kUnit, u, s, half);
                part[g][half] = _mm256_add_epi32(part[g][half], _mm256_madd_epi16(q, pair));
                // Each sum stays one chain in a register: without this GCC re-associates
                // the unrolled pairs' sums into trees whose partial results spill (one row
                // of Q4_K streamed 1.2x slower).
                __asm__("" : "+x"(part[g][half]));
              }
          }
        }
        const int64_t sub = b * kUnits<T> * F::kSubs + i * F::kSubs + h;
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g)
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half) {
            __m256 s, c2;
            scales256<T>(blk + g * F::kHeader, i * F::kSubs + h, half, s, c2);
            acc[g][half] = add_unit256<T>(acc[g][half], part[g][half], s, c2, xs[sub], xsum[sub]);
          }
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int half = 0; half < 2; ++half)
      _mm256_storeu_ps(out + g * kGroup + 8 * half, acc[g][half]);
}

// The sums of MR rows (row stride ldx; their unit scales and sums at stride ldxs) by group g
// of a panel of G groups, in row256's order. Per pair the group's two halves are unpacked,
// then each row's pair is broadcast and multiplied into its two sums: 2 MR + 3 vectors live
// (and each sum kept one chain, as in row256: the trees GCC made of the unrolled sums
// spilled, and the kernel ran 1.5x slower from 16 rows on). The chunk's first tile
// (prefetch) prefetches the panel ahead; the others find it in cache.
template <QType T, int MR>
void rows256(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum, int64_t ldxs,
             const uint8_t* w, int64_t G, int64_t g, int64_t blocks, bool prefetch, float* out) {
  using F = Format<T>;
  constexpr int kRuns = 4 / F::kSubs;
  const int64_t ahead = prefetch_distance<T>(G);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * G * kGroupBlock<T>;
    for (int i = 0; i < kUnits<T>; ++i) {
      const uint8_t* unit = blk + G * F::kHeader + (i * G + g) * F::kUnit;
      const int16_t* xu = xq + b * F::kBlock + i * kUnitInputs;
#pragma GCC unroll 1
      for (int h = 0; h < F::kSubs; ++h) {
        __m256i part[MR][2];
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int u = h * kRuns; u < (h + 1) * kRuns; ++u) {
          if (prefetch) prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            const __m256i q0 = quants256<T>(unit, u, s, 0), q1 = quants256<T>(unit, u, s, 1);
#pragma GCC unroll 4
            for (int m = 0; m < MR; ++m) {
              int32_t xp;
              std::memcpy(&xp, xu + m * ldx + 8 * u + 2 * s, sizeof(xp));
              const __m256i pair = _mm256_set1_epi32(xp);
              part[m][0] = _mm256_add_epi32(part[m][0], _mm256_madd_epi16(q0, pair));
              part[m][1] = _mm256_add_epi32(part[m][1], _mm256_madd_epi16(q1, pair));
              __asm__("" : "+x"(part[m][0]), "+x"(part[m][1]));
            }
          }
        }
        const int64_t sub = b * kUnits<T> * F::kSubs + i * F::kSubs + h;
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m256 s, c2;
          scales256<T>(blk + g * F::kHeader, i * F::kSubs + h, half, s, c2);
#pragma GCC unroll 4
          for (int m = 0; m < MR; ++m) {
            acc[m][half] = add_unit256<T>(acc[m][half], part[m][half], s, c2, xs[m * ldxs + sub],
                                          xsum[m * ldxs + sub]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int half = 0; half < 2; ++half) _mm256_storeu_ps(out + m * kGroup + 8 * half, acc[m][half]);
}
#endif  // GGUF_AVX2

// ---- AMX (AMX-INT8): Q4_0, Q4_1, Q8_0 -----------------------------------------------------
// On CPUs with AMX, Q4_0, Q4_1 and Q8_0 run the AVX2 path's integer sums on tiles (the
// K-quants take the AMX-BF16 tiles below, kBf16Tiles), to the same int32, so that the
// results are the AVX2 path's bit for bit: a row alone (the AVX2 path's one-row tiles) and
// the same row in a batch (tiles) agree, and the process takes AMX by default. x is the
// AVX2 path's 16-bit integers per scale unit, split into two byte planes xq = 256 xh + xl
// (xl unsigned, xh signed); q is the quant itself (Q8_0 signed, the others 0..63), which a
// signed byte holds. Per scale unit, a group's quants are a weight tile (kRowsB rows of 4
// inputs by 16 outputs: a row's 64 bytes are each output's 4 inputs, in the order 0, 2, 1,
// 3, which is how two pairs' decoded words interleave; the byte planes of x take the same
// order), and one tile product of each plane (TDPBUSD for xl, TDPBSSD for xh) gives 16 rows
// by 16 outputs of exact int32 sums; xh's is shifted by 8 and added, then each unit goes
// through the AVX2 path's epilogue (s xs part + c2 xsum, fp32, the same operations in the
// same order). A work item is a chunk of rows by a panel; per scale unit it decodes its
// groups' quants once into a scratch of tiles (512 bytes a group, half the bf16 q' a tile
// product on AMX-BF16 would need) and runs every 16 rows against them (the x planes laid
// out tile by tile, each tile's 16 rows in a run of whole cache lines), the sums kept in a
// per-thread fp32 buffer; of each two groups, the second's products run while the first's
// sums are stored and scaled. Below kAmxMinRows rows they run on AVX512-VNNI, to the same
// sums again: one row alone by a whole panel (row512i: the AVX2 path's one-row tiles, 512
// bits wide), more in tiles of up to kVnniTileRows rows by half a panel (rows512i), each
// unpacked weight vector multiplied into every row's sums.
#if defined(PAGEDLLM_AMX) && defined(GGUF_AVX512) && defined(GGUF_AVX2) && defined(__AMX_INT8__)
#define GGUF_AMX 1
constexpr int64_t kAmxChunkRows = 128;  // rows per work item
// From how many rows the tiles run; fewer, the AVX2 path's sums on AVX512-VNNI. Measured
// on the Xeon (docs/quantization.md): VNNI ran one row in 0.7-0.8x the AVX512-BF16 dot
// products' time (Q8_0 0.35x); with rows512i's tiles 6-8 rows ran in 0.56-0.89x the AMX
// tiles' time, 9 rows in 0.78-1.03x, 10 in 0.78-1.12x, 16 in 1.1-1.5x; measured again at
// 9-12 rows on seven weights (K 576-3072, the bundled model's head among them): 9 rows
// 0.63-0.99x, 10 rows 0.84-1.10x (five of seven faster), 11 and 12 0.65-1.53x.
constexpr int64_t kAmxMinRows = 11;

// The tile paths' work items (chunks of rows by whole panels), each thread taking the next
// item when it is done with one, so that a core the hypervisor or another process holds
// back does not hold the call with a fixed share. Per thread: tiles configured by
// `configure`; per item: body(item, acc) with acc the item's fp32 sums (rows by the
// panel's outputs, zeros to start), then written to y.
template <typename Out, typename Configure, typename Body>
void run_tile_items(const WorkItems& items, Out* y, int64_t ldy, Configure&& configure,
                    Body&& body) {
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    configure();
    static thread_local std::vector<float> acc_buffer;
    acc_buffer.resize(kAmxChunkRows * kPanelGroups * kGroup);
    float* acc = acc_buffer.data();
    for (int64_t it; (it = next_item.fetch_add(1, std::memory_order_relaxed)) < items.count();) {
      const WorkItems::Item item = items[it];
      const int64_t ld_acc = item.NG * kGroup;
      std::fill(acc, acc + item.rows * ld_acc, 0.f);
      body(item, acc);
      for (int64_t j = 0; j < item.rows; ++j)
        store_row(y + (item.m0 + j) * ldy + item.col0, acc + j * ld_acc, item.cols);
    }
    _tile_release();
  });
}

// q of pair 4u + s of a group's unit, 16 outputs' pairs as 16-bit integers (word 2o + e:
// output o's element e): quants256's two halves in one vector.
template <QType T>
inline __m512i quants512(const uint8_t* unit, int u, int s) {
  if constexpr (T == QType::Q8_0)
    return _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + (4 * u + s) * 32)));
  else
    return nibble_words512<T>(unit, u, s, _mm512_setzero_si512());
}

// A group's s and c2 for a scale unit, 16 outputs: scales256's two halves, to the bit (the
// same formula on 16 outputs at once: a third of the instructions of running scales256
// twice, which a one-row call spends per unit and group).
template <QType T>
inline void scales_avx2_512(const uint8_t* header, int sub, __m512& s, __m512& c2) {
  avx2_scales<T>(Lanes16{}, header, sub, s, c2);
}

// add_unit256 on 16 outputs: the same fp32 operations in the same order, so that every
// AVX512-VNNI and AMX path ends each scale unit as the AVX2 path does.
template <QType T>
inline __m512 add_unit512(__m512 acc, __m512i part, __m512 s, __m512 c2, float xs, float xsum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), _mm512_mul_ps(s, _mm512_set1_ps(xs)), acc);
  if constexpr (T != QType::Q8_0) acc = _mm512_fmadd_ps(_mm512_set1_ps(xsum), c2, acc);
  return acc;
}

// row256's sums (the same int32 per scale unit, the same fp32 epilogue) on 512-bit
// vectors: VPDPWSSD multiplies a unit's 16 outputs' pairs by the row's pair and adds both
// products to each output's sum in one instruction.
template <QType T, int NG>
void row512i(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, int64_t G,
             int64_t blocks, float* out) {
  using F = Format<T>;
  constexpr int kRuns = 4 / F::kSubs;
  const int64_t ahead = prefetch_distance<T>(G);
  __m512 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * G * kGroupBlock<T>;
    for (int i = 0; i < kUnits<T>; ++i) {
      const uint8_t* units = blk + G * F::kHeader + i * G * F::kUnit;
      const int16_t* xu = xq + b * F::kBlock + i * kUnitInputs;
#pragma GCC unroll 2
      for (int h = 0; h < F::kSubs; ++h) {
        __m512i part[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) part[g] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int u = h * kRuns; u < (h + 1) * kRuns; ++u) {
          prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            int32_t xp;
            std::memcpy(&xp, xu + 8 * u + 2 * s, sizeof(xp));
            const __m512i pair = _mm512_set1_epi32(xp);
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g)
              part[g] = _mm512_dpwssd_epi32(part[g], quants512<T>(units + g * F::kUnit, u, s), pair);
          }
        }
        const int64_t sub = b * kUnits<T> * F::kSubs + i * F::kSubs + h;
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
          __m512 s, c2;
          scales_avx2_512<T>(blk + g * F::kHeader, i * F::kSubs + h, s, c2);
          acc[g] = add_unit512<T>(acc[g], part[g], s, c2, xs[sub], xsum[sub]);
        }
      }
    }
  }
  for (int g = 0; g < NG; ++g) _mm512_storeu_ps(out + g * kGroup, acc[g]);
}

// row512i for MR rows at once by groups g0, g0 + 1 of the panel (out: row stride ldo): each
// unpacked weight vector feeds every row's VPDPWSSD, where row512i unpacks it again for each
// row. The same int32 per scale unit and the same epilogue per (row, group) as row512i, so
// the same results bit for bit. The half panel starting at group 0 prefetches the panel.
template <QType T, int MR>
void rows512i(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum, int64_t ldxs,
              const uint8_t* w, int64_t G, int64_t g0, int64_t blocks, float* out, int64_t ldo) {
  using F = Format<T>;
  constexpr int kRuns = 4 / F::kSubs;
  const int64_t ahead = prefetch_distance<T>(G);
  const bool prefetch = g0 == 0;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * G * kGroupBlock<T>;
    for (int i = 0; i < kUnits<T>; ++i) {
      const uint8_t* units = blk + G * F::kHeader + (i * G + g0) * F::kUnit;
      const int16_t* xu = xq + b * F::kBlock + i * kUnitInputs;
#pragma GCC unroll 1
      for (int h = 0; h < F::kSubs; ++h) {
        __m512i part[MR][2];
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int u = h * kRuns; u < (h + 1) * kRuns; ++u) {
          if (prefetch) prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
#pragma GCC unroll 4
          for (int s = 0; s < 4; ++s) {
            const __m512i q0 = quants512<T>(units, u, s), q1 = quants512<T>(units + F::kUnit, u, s);
#pragma GCC unroll 4
            for (int m = 0; m < MR; ++m) {
              int32_t xp;
              std::memcpy(&xp, xu + m * ldx + 8 * u + 2 * s, sizeof(xp));
              const __m512i pair = _mm512_set1_epi32(xp);
              part[m][0] = _mm512_dpwssd_epi32(part[m][0], q0, pair);
              part[m][1] = _mm512_dpwssd_epi32(part[m][1], q1, pair);
            }
          }
        }
        const int64_t sub = b * kUnits<T> * F::kSubs + i * F::kSubs + h;
#pragma GCC unroll 2
        for (int g = 0; g < 2; ++g) {
          __m512 sc, c2;
          scales_avx2_512<T>(blk + (g0 + g) * F::kHeader, i * F::kSubs + h, sc, c2);
#pragma GCC unroll 4
          for (int m = 0; m < MR; ++m)
            acc[m][g] = add_unit512<T>(acc[m][g], part[m][g], sc, c2, xs[m * ldxs + sub], xsum[m * ldxs + sub]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < 2; ++g) _mm512_storeu_ps(out + m * ldo + (g0 + g) * kGroup, acc[m][g]);
}

// Rows of xq (16-bit, row stride K) as the byte planes xl (low bytes) and xh (high, signed),
// each four inputs in the order 0, 2, 1, 3, laid out as the tiles that read them: the
// tile of scale unit t (width inputs) and rows 16 mb .. 16 mb + 15 is 16 rows of width
// bytes, at (t Mp / 16 + mb) 16 width, so that a tile load reads whole cache lines in
// order; rows M .. Mp (Mp a multiple of 16) zeros. Rows begin .. end of them.
void split_rows_amx(const int16_t* xq, int64_t M, int64_t Mp, int64_t K, int64_t width, int64_t begin,
                    int64_t end, uint8_t* xl, uint8_t* xh) {
  const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17,
                                         18, 16, 15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
  const int64_t blocks = Mp / 16;
  auto at = [&](int64_t m, int64_t t) { return ((t * blocks + m / 16) * 16 + m % 16) * width; };
  for (int64_t m = begin; m < end; ++m)
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i v = m < M ? _mm512_permutexvar_epi16(order, _mm512_loadu_si512(xq + m * K + k))
                              : _mm512_setzero_si512();
      const __m256i lo = _mm512_cvtepi16_epi8(v), hi = _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8));
      if (width == 32) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xl + at(m, k / 32)), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xh + at(m, k / 32)), hi);
      } else {  // 16
        for (int e = 0; e < 2; ++e) {
          const int64_t o = at(m, k / 16 + e);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xl + o), e ? _mm256_extracti128_si256(lo, 1)
                                                                   : _mm256_castsi256_si128(lo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xh + o), e ? _mm256_extracti128_si256(hi, 1)
                                                                   : _mm256_castsi256_si128(hi));
        }
      }
    }
}

// A group's weight tiles for one unit (32 inputs): 8 rows of 64 bytes, row r pairs 2r and
// 2r + 1, each 16-bit word (output o, element e) their q's side by side.
template <QType T>
inline void quant_tiles_amx(const uint8_t* unit, __m512i* rows) {
  if constexpr (T == QType::Q8_0) {
    for (int r = 0; r < 8; ++r) {
      auto words = [&](int p) {
        return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + p * 32)));
      };
      _mm512_store_si512(rows + r, _mm512_or_si512(words(2 * r), _mm512_slli_epi16(words(2 * r + 1), 8)));
    }
  } else {
    const __m512i low = _mm512_set1_epi16(0x00FF);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
#pragma GCC unroll 2
      for (int s = 0; s < 4; s += 2) {
        // decode512's words are 0x4300 | q: the low byte is q
        const __m512i a = reinterpret_cast<__m512i>(decode512<T>(unit, u, s));
        const __m512i b = reinterpret_cast<__m512i>(decode512<T>(unit, u, s + 1));
        _mm512_store_si512(rows + 2 * u + s / 2,
                           _mm512_ternarylogic_epi32(a, low, _mm512_slli_epi16(b, 8), 0xEA));
      }
  }
}

template <QType T, typename Out>
void run_amx(const at::Tensor& x, const uint8_t* packed, int64_t n, Out* y, int64_t ldy) {
  using F = Format<T>;
  constexpr int kSubs = F::kSubs;
  constexpr int64_t width = kUnitInputs / kSubs;  // a scale unit's inputs
  constexpr uint8_t kRowsB = width / 4;           // a weight tile's rows
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Mp = (M + 15) / 16 * 16, tile_rows = std::min<int64_t>(M, 16);
  const Shape sh = shape_of<T>(n, K);
  const int64_t per_row = K / width;
  // x's preparation, 16 rows a work item: its 16-bit integers per scale unit (the AVX2
  // path's), their byte planes, and each scale unit's row scales and sums row after row
  // (the epilogue reads 16 at a time)
  std::unique_ptr<int16_t[]> xq(new int16_t[M * K]);
  std::vector<float> xscales(M * per_row), sums(M * per_row), unit_rows(2 * per_row * Mp);
  std::unique_ptr<uint8_t[]> planes(new uint8_t[2 * Mp * K]);
  uint8_t *xl = planes.get(), *xh = planes.get() + Mp * K;
  float *row_scales = unit_rows.data(), *row_sums = unit_rows.data() + per_row * Mp;
  at::parallel_for(0, Mp / 16, 1, [&](int64_t begin, int64_t end) {
    const int64_t m0 = begin * 16, m1 = std::min(end * 16, M);
    quantize_rows512(x.data_ptr<at::BFloat16>() + m0 * x.stride(0), x.stride(0), m1 - m0, K, width,
                     xq.get() + m0 * K, xscales.data() + m0 * per_row, sums.data() + m0 * per_row);
    split_rows_amx(xq.get(), M, Mp, K, width, m0, end * 16, xl, xh);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t u = 0; u < per_row; ++u) {
        row_scales[u * Mp + m] = xscales[m * per_row + u];
        row_sums[u * Mp + m] = sums[m * per_row + u];
      }
  });
  // tiles 0-3: two groups' sums of xl and of xh; 4, 5: xl, xh; 6, 7: two groups' quants
  const uint8_t tr = static_cast<uint8_t>(tile_rows);
  auto configure = [&] {
    pagedllm::configure_tiles({tr, tr, tr, tr, tr, tr, kRowsB, kRowsB},
                              {64, 64, 64, 64, width, width, 64, 64});
  };
  const WorkItems items{sh, M, n, kAmxChunkRows, true};
  run_tile_items(items, y, ldy, configure, [&](const WorkItems::Item& item, float* acc) {
    const auto [m0, rows, panel, G, g0, NG, col0, cols] = item;
    const int64_t ld_acc = NG * kGroup;
    const uint8_t* w = packed + panel * sh.panel_bytes;
    const int64_t ahead = prefetch_distance<T>(G);
    // a unit's weight tiles, group after group; units alternate between two, so that
    // decoding the next unit does not wait for the tile loads of this one
    alignas(64) __m512i q[2][kPanelGroups * 8];
    alignas(64) int32_t c_tiles[4][16 * kGroup];
    for (int64_t b = 0; b < sh.blocks; ++b) {
      const uint8_t* blk = w + b * G * kGroupBlock<T>;
      for (int i = 0; i < kUnits<T>; ++i) {
        const uint8_t* units = blk + G * F::kHeader + (i * G + g0) * F::kUnit;
        __m512i* qu = q[(b * kUnits<T> + i) % 2];
        if (items.whole)
          for (int u = 0; u < 4; ++u)
            prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
        for (int64_t g = 0; g < NG; ++g) quant_tiles_amx<T>(units + g * F::kUnit, qu + g * 8);
#pragma GCC unroll 2
        for (int h = 0; h < kSubs; ++h) {
          const int sub = i * kSubs + h;
          const int64_t su = b * kUnits<T> * kSubs + sub;
          __m512 s[kPanelGroups], c2[kPanelGroups];
          for (int64_t g = 0; g < NG; ++g) scales_avx2_512<T>(blk + (g0 + g) * F::kHeader, sub, s[g], c2[g]);
          for (int64_t m = 0; m < rows; m += 16) {
            const int64_t t = (b * F::kBlock + i * kUnitInputs) / width + h;
            const int64_t at = (t * (Mp / 16) + (m0 + m) / 16) * 16 * width;
            _tile_loadd(4, xl + at, width);
            _tile_loadd(5, xh + at, width);
            const int64_t r = std::min<int64_t>(16, rows - m);
            const float* rsc = row_scales + su * Mp + m0 + m;
            const float* rsm = row_sums + su * Mp + m0 + m;
            // one group's epilogue: its sums of xl and xh from c, into acc
            auto finish = [&](const int32_t* cl, const int32_t* ch, int64_t g) {
              float* a = acc + m * ld_acc + g * kGroup;
              const __m512 sg = s[g], dg = c2[g];
              for (int64_t j = 0; j < r; ++j, a += ld_acc) {
                const __m512i p = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch + j * kGroup), 8),
                                                   _mm512_load_si512(cl + j * kGroup));
                _mm512_storeu_ps(a, add_unit512<T>(_mm512_loadu_ps(a), p, sg, dg, rsc[j], rsm[j]));
              }
            };
            for (int64_t g = 0; g < NG; g += 2) {
              // group g on tiles 0, 1 (quants 6), group g + 1 on 2, 3 (7): the second's
              // products run while the first's sums are stored and scaled
              _tile_loadd(6, qu + g * 8 + h * kRowsB, 64);
              _tile_zero(0);
              _tile_zero(1);
              _tile_dpbusd(0, 4, 6);
              _tile_dpbssd(1, 5, 6);
              _tile_loadd(7, qu + (g + 1) * 8 + h * kRowsB, 64);
              _tile_zero(2);
              _tile_zero(3);
              _tile_dpbusd(2, 4, 7);
              _tile_dpbssd(3, 5, 7);
              _tile_stored(0, c_tiles[0], 64);
              _tile_stored(1, c_tiles[1], 64);
              finish(c_tiles[0], c_tiles[1], g);
              _tile_stored(2, c_tiles[2], 64);
              _tile_stored(3, c_tiles[3], 64);
              finish(c_tiles[2], c_tiles[3], g + 1);
            }
          }
        }
      }
    }
  });
}

// ---- AMX-BF16 tiles (the K-quants) -------------------------------------------------------
// The other way to run the tiles: q' as it is the AVX-512 path's (128 + q, exact in bf16)
// against x as it is (bf16, not rounded to integers): one TDPBF16PS per scale unit, group
// and 16 rows (a whole 64-byte tile row of K, where the integer tiles take two half-width
// products, one per byte plane of x), each unit's fp32 sums then scaled as the AVX-512 path
// scales them (sum s + sum(x) c, two multiply-adds where the integer epilogue takes six
// operations). A unit's weight tile is decode512's 16 vectors as they come (pair p of the
// unit is tile row p: 16 outputs' pairs side by side, the layout TDPBF16PS reads). Every
// output's sum is a sequence of tile products fixed by its scale units, so a row alone, in
// any batch and on any thread gets the same bits. One row runs on the tiles too
// (row_bf16_tiles: 1-row tiles, a panel at a time): a product's sums are c + (E + O), two
// fp32 chains over the even and the odd pairs, which FMAs could give bit for bit, but at 6
// vector operations per 32 weights against VNNI's 3 they ran a row no faster than the
// tiles (docs/quantization.md, 2026-11-29). Measured on the Xeon against the integer
// tiles and VNNI (2026-11-30): 16-256 rows in 0.56-0.73x the time (Q6_K 0.59-0.67x), one
// row 1.6-2x (Q8_0 3.4x), which costs single-stream decode 0-6% on a Q4_K_M file (the
// bytes from memory hide most of it) and gives its W1 1.31x and its time to first token
// 1.4x; but a model whose weights stay in the cache is bound by that one-row work (the
// bundled Q4_1 SmolLM2 decoded at 0.79x, the Q8_0 Qwen3 at 0.62x: Q8_0's bytes take five
// operations to become bf16). So the K-quants, the types of the files users bring at real
// sizes, take the bf16 tiles; Q4_0, Q4_1 and Q8_0 keep the integer sums.
template <QType T>
constexpr bool kBf16Tiles = T == QType::Q4_K || T == QType::Q5_K || T == QType::Q6_K;

// Unit j of a whole panel of G groups at w (blocks after blocks) as weight tiles: its q',
// pair p of group g at q[g][p], the panel prefetched `ahead` bytes on.
template <QType T>
inline void bf16_unit_tiles(const uint8_t* w, int64_t G, int64_t ahead, int64_t j, __m512bh (*q)[16]) {
  using F = Format<T>;
  const uint8_t* blk = w + j / kUnits<T> * G * kGroupBlock<T>;
  const int i = j % kUnits<T>;
  for (int u = 0; u < 4; ++u)
    prefetch_slice(blk + ahead, G * kGroupBlock<T>, i * 4 + u, kUnits<T> * 4);
  const uint8_t* units = blk + G * F::kHeader + i * G * F::kUnit;
  for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) q[g][4 * u + s] = decode512<T>(units + g * F::kUnit, u, s);
}

// Many rows (2 and up): work items of a chunk of rows by a whole panel, taken by each thread
// as it is free. Per unit the panel's q' is decoded one unit ahead of its products (a tile
// load of vectors just stored waits for them to reach the cache) into one of two buffers;
// tiles: 0 x (16 rows of the unit's inputs, read in place), 1-4 the groups' q', 5-7 sums.
template <QType T, typename Out>
void run_bf16_tiles(const at::Tensor& x_in, const uint8_t* packed, int64_t n, Out* y, int64_t ldy) {
  using F = Format<T>;
  constexpr int kSubs = F::kSubs;
  constexpr int64_t width = kUnitInputs / kSubs;  // a scale unit's inputs
  constexpr uint8_t kRowsB = width / 2;           // its pairs: a weight tile's rows
  const int64_t M = x_in.size(0), K = x_in.size(1);
  // beyond one tile of rows, whole tiles (the rest zeros: tiles read 16 rows)
  const at::Tensor x = M > 16 && M % 16 != 0
      ? at::constant_pad_nd(x_in, {0, 0, 0, 16 - M % 16}, 0) : x_in;
  const int64_t ldx = x.stride(0), Mp = x.size(0);
  const Shape sh = shape_of<T>(n, K);
  const int64_t per_row = K / width;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  // each scale unit's sums of x, unit after unit, the rows side by side
  std::vector<float> unit_rows;
  if constexpr (F::kOffset) {
    std::vector<float> sums(M * per_row);
    unit_sums512(xp, ldx, M, K, width, 1.f, sums.data());
    unit_rows.resize(per_row * Mp);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t u = 0; u < per_row; ++u) unit_rows[u * Mp + m] = sums[m * per_row + u];
  }
  const uint8_t tr = static_cast<uint8_t>(std::min<int64_t>(M, 16));
  auto configure = [&] {
    pagedllm::configure_tiles({tr, kRowsB, kRowsB, kRowsB, kRowsB, tr, tr, tr},
                              {width * 2, 64, 64, 64, 64, 64, 64, 64});
  };
  const WorkItems items{sh, M, n, kAmxChunkRows, true};
  run_tile_items(items, y, ldy, configure, [&](const WorkItems::Item& item, float* acc) {
    const auto [m0, rows, panel, G, g0, NG, col0, cols] = item;
    const int64_t ld_acc = NG * kGroup;
    const uint8_t* w = packed + panel * sh.panel_bytes;
    const int64_t ahead = prefetch_distance<T>(G);
    const int64_t units = sh.blocks * kUnits<T>;
    alignas(64) __m512bh q[2][kPanelGroups][16];  // unit j's q' in q[j % 2]
    alignas(64) float c_tiles[3][16 * kGroup];
    bf16_unit_tiles<T>(w, G, ahead, 0, q[0]);
    for (int64_t j = 0; j < units; ++j) {
      if (j + 1 < units) bf16_unit_tiles<T>(w, G, ahead, j + 1, q[(j + 1) % 2]);
      const int64_t b = j / kUnits<T>;
      const int i = j % kUnits<T>;
      const uint8_t* blk = w + b * G * kGroupBlock<T>;
#pragma GCC unroll 2
      for (int h = 0; h < kSubs; ++h) {
        const int sub = i * kSubs + h;
        const int64_t su = b * kUnits<T> * kSubs + sub;
        __m512 s[kPanelGroups], c[kPanelGroups];
        for (int64_t g = 0; g < NG; ++g) scales512<T>(blk + g * F::kHeader, sub, s[g], c[g]);
        _tile_loadd(1, &q[j % 2][0][h * kRowsB], 64);
        _tile_loadd(2, &q[j % 2][1][h * kRowsB], 64);
        if (NG == 4) {
          _tile_loadd(3, &q[j % 2][2][h * kRowsB], 64);
          _tile_loadd(4, &q[j % 2][3][h * kRowsB], 64);
        }
        for (int64_t m = 0; m < rows; m += 16) {
          _tile_loadd(0, xp + (m0 + m) * ldx + b * F::kBlock + i * kUnitInputs + h * width, ldx * 2);
          const int64_t r = std::min<int64_t>(16, rows - m);
          const float* xsum = F::kOffset ? unit_rows.data() + su * Mp + m0 + m : nullptr;
          // group g's sums (at ct) scaled into acc
          auto finish = [&](const float* ct, int64_t g) {
            float* a = acc + m * ld_acc + g * kGroup;
            for (int64_t row = 0; row < r; ++row, a += ld_acc) {
              __m512 v = _mm512_fmadd_ps(_mm512_load_ps(ct + row * kGroup), s[g], _mm512_loadu_ps(a));
              if constexpr (F::kOffset) v = _mm512_fmadd_ps(_mm512_set1_ps(xsum[row]), c[g], v);
              _mm512_storeu_ps(a, v);
            }
          };
          // each group's products on a sums tile while an earlier group's are scaled
          _tile_zero(5);
          _tile_dpbf16ps(5, 0, 1);
          _tile_zero(6);
          _tile_dpbf16ps(6, 0, 2);
          _tile_stored(5, c_tiles[0], 64);
          if (NG == 4) {
            _tile_zero(7);
            _tile_dpbf16ps(7, 0, 3);
          }
          finish(c_tiles[0], 0);
          _tile_stored(6, c_tiles[1], 64);
          if (NG == 4) {
            _tile_zero(5);
            _tile_dpbf16ps(5, 0, 4);
          }
          finish(c_tiles[1], 1);
          if (NG == 4) {
            _tile_stored(7, c_tiles[2], 64);
            finish(c_tiles[2], 2);
            _tile_stored(5, c_tiles[0], 64);
            finish(c_tiles[0], 3);
          }
        }
      }
    }
  });
}

// One row: run_bf16_tiles's products and sums on 1-row tiles, the threads splitting the
// panels, each panel's sums in registers; each unit's q' decoded one unit ahead of its
// products and its sums scaled one unit behind (read once the tile stores have landed).
template <QType T, typename Out>
void row_bf16_tiles(const at::Tensor& x, const uint8_t* packed, int64_t n, Out* y) {
  using F = Format<T>;
  constexpr int kSubs = F::kSubs;
  constexpr int64_t width = kUnitInputs / kSubs;
  constexpr uint8_t kRowsB = width / 2;
  const int64_t K = x.size(1);
  const Shape sh = shape_of<T>(n, K);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  std::vector<float> sums(K / width);
  if constexpr (F::kOffset) unit_sums512(xp, K, 1, K, width, 1.f, sums.data());
  at::parallel_for(0, sh.panels, 1, [&](int64_t begin, int64_t end) {
    pagedllm::configure_tiles({1, kRowsB, kRowsB, kRowsB, kRowsB, 1, 1, 1},
                              {width * 2, 64, 64, 64, 64, 64, 64, 64});
    alignas(64) __m512bh q[2][kPanelGroups][16];
    alignas(64) float c_rows[2][kSubs][kPanelGroups][kGroup];
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t G = sh.groups_in(panel);
      const uint8_t* w = packed + panel * sh.panel_bytes;
      const int64_t ahead = prefetch_distance<T>(G);
      const int64_t units = sh.blocks * kUnits<T>;
      __m512 acc[kPanelGroups];
      for (int g = 0; g < kPanelGroups; ++g) acc[g] = _mm512_setzero_ps();
      auto finish = [&](int64_t j) {  // unit j's sums (c_rows[j % 2]) scaled into acc
        const int64_t b = j / kUnits<T>;
        const int i = j % kUnits<T>;
        const uint8_t* blk = w + b * G * kGroupBlock<T>;
#pragma GCC unroll 2
        for (int h = 0; h < kSubs; ++h) {
          const int sub = i * kSubs + h;
          for (int64_t g = 0; g < G; ++g) {
            __m512 s, c;
            scales512<T>(blk + g * F::kHeader, sub, s, c);
            acc[g] = _mm512_fmadd_ps(_mm512_load_ps(c_rows[j % 2][h][g]), s, acc[g]);
            if constexpr (F::kOffset)
              acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(sums[b * kUnits<T> * kSubs + sub]), c, acc[g]);
          }
        }
      };
      bf16_unit_tiles<T>(w, G, ahead, 0, q[0]);
      for (int64_t j = 0; j < units; ++j) {
        if (j + 1 < units) bf16_unit_tiles<T>(w, G, ahead, j + 1, q[(j + 1) % 2]);
        const int64_t b = j / kUnits<T>;
        const int i = j % kUnits<T>;
#pragma GCC unroll 2
        for (int h = 0; h < kSubs; ++h) {
          _tile_loadd(0, xp + b * F::kBlock + i * kUnitInputs + h * width, 64);
          _tile_loadd(1, &q[j % 2][0][h * kRowsB], 64);
          _tile_loadd(2, &q[j % 2][1][h * kRowsB], 64);
          _tile_zero(5);
          _tile_dpbf16ps(5, 0, 1);
          _tile_zero(6);
          _tile_dpbf16ps(6, 0, 2);
          _tile_stored(5, c_rows[j % 2][h][0], 64);
          _tile_stored(6, c_rows[j % 2][h][1], 64);
          if (G == 4) {
            _tile_loadd(3, &q[j % 2][2][h * kRowsB], 64);
            _tile_loadd(4, &q[j % 2][3][h * kRowsB], 64);
            _tile_zero(7);
            _tile_dpbf16ps(7, 0, 3);
            _tile_zero(5);
            _tile_dpbf16ps(5, 0, 4);
            _tile_stored(7, c_rows[j % 2][h][2], 64);
            _tile_stored(5, c_rows[j % 2][h][3], 64);
          }
        }
        if (j > 0) finish(j - 1);
      }
      finish(units - 1);
      alignas(64) float out[kPanelGroups * kGroup];
      for (int64_t g = 0; g < G; ++g) _mm512_store_ps(out + g * kGroup, acc[g]);
      const int64_t col0 = panel * kPanelGroups * kGroup;
      store_row(y + col0, out, std::min(G * kGroup, n - col0));
    }
    _tile_release();
  });
}
#endif  // GGUF_AMX

// Which path gguf_linear takes: AMX tiles where the CPU has them (the K-quants bf16 tiles at
// every row count; the others integer tiles from kAmxMinRows rows and, fewer, the AVX2
// path's sums on AVX512-VNNI), else the dot products (AVX-512, else AVX2); tests may ask
// for a path the CPU also has.
enum class Isa { kNone, kAvx2, kAvx512, kAmx };
std::atomic<Isa> forced_isa{Isa::kNone};

Isa current_isa() {
  const Isa forced = forced_isa.load();
  if (forced != Isa::kNone) return forced;
#if defined(GGUF_AMX)
  if (pagedllm::amx_available()) return Isa::kAmx;
#endif
#if defined(GGUF_AVX512)
  return Isa::kAvx512;
#elif defined(GGUF_AVX2)
  return Isa::kAvx2;
#else
  return Isa::kNone;
#endif
}

// y[:, :n] = x . w^T from the packed weight: work items are (chunk of rows, panel) up to
// kFewRows rows, else (chunk, half a panel: 2 groups), split between the threads.
template <QType T, typename Out>
void run(const at::Tensor& x, const uint8_t* packed, int64_t n, Out* y, int64_t ldy, Isa isa) {
  using F = Format<T>;
  bool vnni = false;  // the AVX2 path's one-row tiles on AVX512-VNNI
#if defined(GGUF_AMX)
  if (isa == Isa::kAmx) {
    if constexpr (kBf16Tiles<T>) {
      if (x.size(0) == 1) return row_bf16_tiles<T>(x, packed, n, y);
      return run_bf16_tiles<T>(x, packed, n, y, ldy);
    }
    if (x.size(0) >= kAmxMinRows) return run_amx<T>(x, packed, n, y, ldy);
    isa = Isa::kAvx2;
    vnni = true;
  }
#endif
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const Shape sh = shape_of<T>(n, K);
  const int64_t width = kUnitInputs / F::kSubs, per_row = K / width;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const bool few = vnni || M <= (isa == Isa::kAvx512 ? F::kFewRows512 : kFewRows);
  std::vector<float> sums(M * per_row), xscales;
#if defined(GGUF_AVX2)
  std::vector<int16_t> xq;
  if (isa == Isa::kAvx2) {
    xq.resize(M * K);
    xscales.resize(M * per_row);
#if defined(GGUF_AMX)
    if (vnni) quantize_rows512(xp, ldx, M, K, width, xq.data(), xscales.data(), sums.data());
    else
#endif
      quantize_rows256(xp, ldx, M, K, width, xq.data(), xscales.data(), sums.data());
  }
#endif
#if defined(GGUF_AVX512)
  std::vector<int32_t> xt;
  if (isa == Isa::kAvx512) {
    unit_sums512(xp, ldx, M, K, width, F::kFold != 0.f ? F::kFold : 1.f, sums.data());
    if (!few) {
      xt.resize(M * K / 2);
      interleave_rows512(xp, ldx, M, K, xt.data());
    }
  }
#endif
  const WorkItems items{sh, M, n, kChunkRows, few};  // whole panels for few rows
  at::parallel_for(0, items.count(), 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kVnniTileRows * 4 * kGroup];  // one tile's sums
    for (int64_t i = begin; i < end; ++i) {
      const auto [m0, rows, panel, G, g0, NG, col0, cols] = items[i];
      const uint8_t* w = packed + panel * sh.panel_bytes;
      const float* xs = sums.data() + m0 * per_row;
      auto store_rows = [&](int64_t m, int64_t r) {
        for (int64_t j = 0; j < r; ++j)
          store_row(y + (m0 + m + j) * ldy + col0, out + j * NG * kGroup, cols);
      };
#if defined(GGUF_AVX512)
      if (isa == Isa::kAvx512) {
        const at::BFloat16* xr = xp + m0 * ldx;
        if (few) {
          for (int64_t m = 0; m < rows; ++m) {
            if (G == 4)
              tile512<T, 1, 4>(xr + m * ldx, ldx, xs + m * per_row, per_row, w, G, 0, sh.blocks, out);
            else
              tile512<T, 1, 2>(xr + m * ldx, ldx, xs + m * per_row, per_row, w, G, 0, sh.blocks, out);
            store_rows(m, 1);
          }
        } else {
          static thread_local std::vector<__m512i> scratch;
          const bool keep = rows > kTileRows && rows >= F::kKeepRows;
          if (keep) scratch.resize(per_row * kScratchVectors<T>);
          for (int64_t m = 0; m < rows; m += kTileRows) {
            const int64_t r = std::min<int64_t>(kTileRows, rows - m);
            auto tile = [&]<bool kUnpack, bool kKeep>() {
              rows512<T, kTileRows, kUnpack, kKeep>(r, xt.data() + (m0 + m) * K / 2,
                                                    xs + m * per_row, per_row, w, G, g0,
                                                    sh.blocks, scratch.data(), out);
            };
            if constexpr (F::kKeepRows == kNeverKeep) {  // (no keeping tiles built)
              tile.template operator()<true, false>();
            } else {
              if (!keep) tile.template operator()<true, false>();
              else if (m == 0) tile.template operator()<true, true>();
              else tile.template operator()<false, false>();
            }
            store_rows(m, r);
          }
        }
      }
#endif
#if defined(GGUF_AVX2)
      if (isa == Isa::kAvx2) {
        // A row alone takes the whole panel (its fp32 sums spill, touched once a scale
        // unit; walking a panel as two tiles of 2 groups left memory idle while the second
        // ran from L2); many rows, tiles of up to kTileRows rows by one group.
        const int16_t* xr = xq.data() + m0 * K;
        const float* xsr = xscales.data() + m0 * per_row;
#if defined(GGUF_AMX)
        if (vnni && rows > 1) {  // tiles of up to kVnniTileRows rows by half panels
          for (int64_t m = 0; m < rows; m += kVnniTileRows) {
            const int64_t r = std::min<int64_t>(kVnniTileRows, rows - m);
            auto tile = [&]<int MR>() {
              for (int64_t g = 0; g < G; g += 2)
                rows512i<T, MR>(xr + m * K, K, xsr + m * per_row, xs + m * per_row, per_row, w, G,
                                g, sh.blocks, out, G * kGroup);
            };
            switch (r) {
              case 1: tile.template operator()<1>(); break;
              case 2: tile.template operator()<2>(); break;
              case 3: tile.template operator()<3>(); break;
              case 4: tile.template operator()<4>(); break;
              default: tile.template operator()<5>(); break;
            }
            store_rows(m, r);
          }
          continue;
        }
#endif
        if (few) {
          for (int64_t m = 0; m < rows; ++m) {
            auto row = [&]<int NG>() {
#if defined(GGUF_AMX)
              if (vnni)
                return row512i<T, NG>(xr + m * K, xsr + m * per_row, xs + m * per_row, w, G, sh.blocks, out);
#endif
              row256<T, NG>(xr + m * K, xsr + m * per_row, xs + m * per_row, w, G, sh.blocks, out);
            };
            if (G == 4) row.template operator()<4>();
            else row.template operator()<2>();
            store_rows(m, 1);
          }
        } else {
          for (int64_t m = 0; m < rows; m += kTileRows) {
            const int64_t r = std::min<int64_t>(kTileRows, rows - m);
            auto tile = [&]<int MR>() {
              for (int64_t g = 0; g < NG; ++g) {
                alignas(64) float part[MR * kGroup];
                rows256<T, MR>(xr + m * K, K, xsr + m * per_row, xs + m * per_row, per_row, w, G,
                               g0 + g, sh.blocks, m == 0, part);
                for (int64_t j = 0; j < MR; ++j)
                  std::memcpy(out + j * NG * kGroup + g * kGroup, part + j * kGroup,
                              kGroup * sizeof(float));
              }
            };
            switch (r) {
              case 1: tile.template operator()<1>(); break;
              case 2: tile.template operator()<2>(); break;
              case 3: tile.template operator()<3>(); break;
              default: tile.template operator()<4>(); break;
            }
            store_rows(m, r);
          }
        }
      }
#endif
    }
  });
}

template <QType T>
int64_t packed_nbytes(int64_t n, int64_t k) {
  const Shape sh = shape_of<T>(n, k);
  return sh.groups * sh.blocks * kGroupBlock<T>;
}

// Calls f.template operator()<T>() for the run-time type (a TORCH_CHECK error for others).
template <typename Fn>
auto dispatch(int64_t qtype, Fn&& f) {
  switch (static_cast<QType>(qtype)) {
    case QType::Q4_0: return f.template operator()<QType::Q4_0>();
    case QType::Q4_1: return f.template operator()<QType::Q4_1>();
    case QType::Q8_0: return f.template operator()<QType::Q8_0>();
    case QType::Q4_K: return f.template operator()<QType::Q4_K>();
    case QType::Q5_K: return f.template operator()<QType::Q5_K>();
    case QType::Q6_K: return f.template operator()<QType::Q6_K>();
  }
  TORCH_CHECK(false, "gguf_linear: ggml type ", qtype,
              " is not one the kernel takes (Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
}

// The packed weight checked against its type and shape (K from x or given).
template <QType T>
void check_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(n > 0 && k > 0 && k % Format<T>::kBlock == 0, "gguf_linear: a weight [", n, ", ", k,
              "] of this type needs K a multiple of ", Format<T>::kBlock);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == packed_nbytes<T>(n, k),
              "gguf_linear: packed must be pack_gguf's uint8 tensor for this type and [", n, ", ",
              k, "] (", packed_nbytes<T>(n, k), " bytes), got ", packed.scalar_type(), " ",
              packed.sizes());
}

// The exact weight of output r at input j from the packed form (fp32 in gguf's order of
// operations, so equal to gguf.quants.dequantize bit for bit).
template <QType T>
float packed_weight(const uint8_t* packed, const Shape& sh, int64_t r, int64_t j) {
  using F = Format<T>;
  const int64_t group = r / kGroup, o = r % kGroup, panel = group / kPanelGroups;
  const int64_t G = sh.groups_in(panel), gp = group % kPanelGroups;
  const int64_t b = j / F::kBlock, i = j % F::kBlock / kUnitInputs, p = j % kUnitInputs / 2,
                e = j % 2;
  const uint8_t* blk = packed + panel * sh.panel_bytes + b * G * kGroupBlock<T>;
  const uint8_t* header = blk + gp * F::kHeader;
  const uint8_t* unit = blk + G * F::kHeader + (i * G + gp) * F::kUnit;
  auto word = [&](int64_t at) {
    uint16_t v;
    std::memcpy(&v, unit + at + 2 * (2 * o + e), 2);
    return v;
  };
  auto half = [&](int64_t at) {
    return static_cast<float>(c10::Half(
        static_cast<uint16_t>(header[at + 2 * o] | header[at + 2 * o + 1] << 8), c10::Half::from_bits()));
  };
  if constexpr (T == QType::Q8_0)
    return static_cast<float>(static_cast<int8_t>(unit[p * 32 + 2 * o + e])) * half(0);
  int q = word(p / 4 * 64) >> (4 * (p % 4)) & 0xF;
  if constexpr (T == QType::Q5_K) q |= (word(256) >> p & 1) << 4;
  if constexpr (T == QType::Q6_K) q |= (word(256 + p / 8 * 64) >> (2 * (p % 8)) & 3) << 4;
  if constexpr (T == QType::Q4_0) return static_cast<float>(q - 8) * half(0);
  if constexpr (T == QType::Q4_1) return static_cast<float>(q) * half(0) + half(32);
  if constexpr (T == QType::Q6_K) {
    const int sub = i * 2 + p / 8;
    return half(0) * static_cast<float>(static_cast<int8_t>(header[32 + 16 * sub + o])) *
           static_cast<float>(q - 32);
  }
  // Q4_K, Q5_K: (d sc) q - dmin mn
  const float scale = half(0) * static_cast<float>(header[64 + 16 * i + o]);
  const float min = half(32) * static_cast<float>(header[192 + 16 * i + o]);
  return scale * static_cast<float>(q) - min;
}

}  // namespace

namespace pagedllm {

std::string gguf_linear_isa() {
  switch (current_isa()) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512_bf16";
    case Isa::kAvx2: return "avx2";
    default: return "";
  }
}

void force_gguf_linear_isa(const std::string& isa) {
  TORCH_CHECK(isa.empty() || isa == "avx2" || isa == "avx512_bf16" || isa == "amx",
              "force_gguf_linear_isa: \"amx\", \"avx512_bf16\", \"avx2\" or \"\", got \"", isa, "\"");
#if defined(GGUF_AMX)
  const bool amx = amx_available();
#else
  const bool amx = false;
#endif
#if defined(GGUF_AVX512)
  const bool avx512 = true;
#else
  const bool avx512 = false;
#endif
  TORCH_CHECK(isa != "amx" || amx, "force_gguf_linear_isa: AMX tiles need a CPU with AMX-INT8 "
              "and a build for it");
  TORCH_CHECK(isa != "avx512_bf16" || avx512, "force_gguf_linear_isa: this build has no "
              "AVX512-BF16 path");
  forced_isa = isa == "avx2" ? Isa::kAvx2 : isa == "amx" ? Isa::kAmx
      : isa == "avx512_bf16" ? Isa::kAvx512 : Isa::kNone;
}

int64_t gguf_packed_nbytes(int64_t qtype, int64_t n, int64_t k) {
  return dispatch(qtype, [&]<QType T>() { return packed_nbytes<T>(n, k); });
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& out, bool fp32_out) {
  const Isa isa = current_isa();
  TORCH_CHECK(isa != Isa::kNone, "gguf_linear: this build has neither AVX512-BF16 nor AVX2+FMA+F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be bf16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  dispatch(qtype, [&]<QType T>() { check_packed<T>(packed, n, K); return 0; });
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const auto dtype = fp32_out ? at::kFloat : at::kBFloat16;
  at::Tensor y;
  if (out.has_value()) {
    y = *out;
    TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) >= n && y.stride(1) == 1 &&
                    y.scalar_type() == dtype,
                "gguf_linear: out must be ", dtype, " [", M, ", >= ", n,
                "] with unit column stride, got ", y.scalar_type(), " ", y.sizes(), " strides ",
                y.strides());
  } else {
    y = at::empty({M, n}, x.options().dtype(dtype));
  }
  if (M == 0) return out.has_value() ? y.narrow(1, 0, n) : y;
  dispatch(qtype, [&]<QType T>() {
    if (fp32_out) run<T>(xc, packed.data_ptr<uint8_t>(), n, y.data_ptr<float>(), y.stride(0), isa);
    else run<T>(xc, packed.data_ptr<uint8_t>(), n, y.data_ptr<at::BFloat16>(), y.stride(0), isa);
    return 0;
  });
  return out.has_value() ? y.narrow(1, 0, n) : y;
}

at::Tensor gguf_dequantize_rows(const at::Tensor& packed, int64_t qtype, int64_t n, int64_t k,
                                const at::Tensor& rows) {
  dispatch(qtype, [&]<QType T>() { check_packed<T>(packed, n, k); return 0; });
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "gguf_dequantize_rows: rows must be a 1-D int64 tensor");
  const at::Tensor r = rows.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < n, "gguf_dequantize_rows: row ", rp[i], " outside 0..", n - 1);
  at::Tensor w = at::empty({r.numel(), k}, packed.options().dtype(at::kFloat));
  float* wp = w.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  dispatch(qtype, [&]<QType T>() {
    const Shape sh = shape_of<T>(n, k);
    for (int64_t i = 0; i < r.numel(); ++i)
      for (int64_t j = 0; j < k; ++j) wp[i * k + j] = packed_weight<T>(pp, sh, rp[i], j);
    return 0;
  });
  return w;
}

}  // namespace pagedllm
