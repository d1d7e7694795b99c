// Vector helpers shared by the kernels.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>

namespace pagedllm::lanes {

// The few operations the functions below take, overloaded for a register of 16 (AVX-512)
// and of 8 (AVX2 + FMA) fp32 lanes: each function is written once for both widths, and each
// width computes exactly what it did when it had its own copy. (Overloads, not a traits
// class: a vector type as a class template's argument loses its attributes.)
#if defined(__AVX512F__)
inline __m512 splat(__m512, float c) { return _mm512_set1_ps(c); }
inline __m512 min(__m512 a, __m512 b) { return _mm512_min_ps(a, b); }
inline __m512 max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline __m512 round(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m512 scale2(__m512 p, __m512 k) { return _mm512_scalef_ps(p, k); }  // p 2^k
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 splat(__m256, float c) { return _mm256_set1_ps(c); }
inline __m256 min(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
inline __m256 max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
inline __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 div(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
inline __m256 round(__m256 x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p 2^k by 2^k's exponent bits (k in [-126, 127] here): exactly what scalef gives
inline __m256 scale2(__m256 p, __m256 k) {
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// e^x for x <= 88 (softmax arguments, SiLU): x = k ln2 + y with |y| <= ln2/2 (ln2 split in two
// for exactness), e^y by its Taylor series to degree 7 (relative error < 1e-7), times 2^k.
template <typename V>
inline V exp(V x) {
  x = min(max(x, splat(x, -87.f)), splat(x, 88.f));
  const V k = round(mul(x, splat(x, 1.4426950408889634f)));
  V y = fnmadd(k, splat(x, 0.693145751953125f), x);
  y = fnmadd(k, splat(x, 1.428606765330187e-06f), y);
  V p = splat(x, 1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = fmadd(p, y, splat(x, c));
  return scale2(p, k);
}

// tanh(x), as Eigen's fast tanh: x P(x^2) / Q(x^2) on x clamped to +-7.9 (where tanh
// is 1 in fp32); relative error < 4e-7 (measured against fp64 over [-12, 12]).
template <typename V>
inline V tanh(V x) {
  const float kClamp = 7.90531110763549805f;
  x = min(max(x, splat(x, -kClamp)), splat(x, kClamp));
  const V x2 = mul(x, x);
  V p = splat(x, -2.76076847742355e-16f);
  for (float c : {2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f,
                  1.48572235717979e-05f, 6.37261928875436e-04f, 4.89352455891786e-03f})
    p = fmadd(p, x2, splat(x, c));
  V q = splat(x, 1.19825839466702e-06f);
  for (float c : {1.18534705686654e-04f, 2.26843463243900e-03f, 4.89352518554385e-03f})
    q = fmadd(q, x2, splat(x, c));
  return div(mul(p, x), q);
}

}  // namespace pagedllm::lanes
#endif

#if defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace pagedllm {

inline __m512 exp16(__m512 x) { return lanes::exp(x); }
inline __m512 tanh16(__m512 x) { return lanes::tanh(x); }

// Soft-capped scores: cap * tanh(x / cap), lane-wise.
inline __m512 softcap16(__m512 x, float cap) {
  return _mm512_mul_ps(tanh16(_mm512_div_ps(x, _mm512_set1_ps(cap))), _mm512_set1_ps(cap));
}

// 16 values of T widened to fp32, and fp32 rounded to T (round to nearest even, NaN kept:
// exactly c10's conversion) and stored.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  // The CPU's own conversion rounds to nearest even like c10's, but flushes denormals and
  // keeps a NaN's sign and payload: it takes every vector without NaN or denormal.
  if (!_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80)) {  // quiet NaN, denormal, signaling NaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    return;
  }
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                              _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// Round to T and back (the value torch keeps after an op in dtype T). For bf16 in registers:
// store16's rounding with the low half cleared instead of shifted out (and back in).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
        _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                                _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

}  // namespace pagedllm

#endif  // __AVX512F__

// ---- vec: one register of fp32 lanes, the widest this build has ----------------------
// The elementwise kernels (elementwise.cpp) are written once against these: 16 lanes on
// AVX-512 (the helpers above), 8 on AVX2 + FMA + F16C (AMD Zen 2/3, most laptops), with
// the same algorithms (exp, tanh, c10's rounding to bf16), so the two differ only where a
// reduction's order does. PAGEDLLM_VEC_WIDTH is 0 where neither is built.
#if defined(__AVX512F__)
#define PAGEDLLM_VEC_WIDTH 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_VEC_WIDTH 8
#else
#define PAGEDLLM_VEC_WIDTH 0
#endif

#if PAGEDLLM_VEC_WIDTH == 8
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <type_traits>
#endif

#if PAGEDLLM_VEC_WIDTH > 0
namespace pagedllm::vec {

constexpr int kWidth = PAGEDLLM_VEC_WIDTH;

#if PAGEDLLM_VEC_WIDTH == 16
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
// a lane that is NaN; a lane equal to t
inline bool any_nan(V v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
inline bool any_equal(V v, V t) { return _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ) != 0; }
template <typename T>
inline V load(const T* p) { return load16(p); }
template <typename T>
inline void store(T* p, V v) { store16(p, v); }
template <typename T>
inline V round(V v) { return round16<T>(v); }
inline V exp(V x) { return lanes::exp(x); }
inline V tanh(V x) { return lanes::tanh(x); }

#else  // 8 lanes: AVX2 + FMA + F16C
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline float reduce_add(V v) {  // halves added pairwise, as _mm512_reduce_add_ps does
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float reduce_max(V v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline bool any_nan(V v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
inline bool any_equal(V v, V t) { return _mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_EQ_OQ)) != 0; }

inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// fp32 bits rounded to bf16 in the high half (c10's round to nearest even; NaN -> 0x7FC0)
inline __m256i bf16_bits(V v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
      _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                                              _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, V v) {
  const __m256i r = _mm256_srli_epi32(bf16_bits(v), 16);  // 0..0xFFFF: packus keeps them
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void store(c10::Half* p, V v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline V round(V v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(bf16_bits(v));
  } else {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}
inline V exp(V x) { return lanes::exp(x); }
inline V tanh(V x) { return lanes::tanh(x); }
#endif

}  // namespace pagedllm::vec
#endif  // PAGEDLLM_VEC_WIDTH > 0
