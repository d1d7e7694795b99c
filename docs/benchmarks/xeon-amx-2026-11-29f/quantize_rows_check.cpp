// The check behind d06ded4: quantize_rows512 against quantize_rows256 (renamed _ref here),
// both copied from pagedllm/kernels/csrc/gguf_linear.cpp as of that commit (a snapshot: the
// kernel's own tests compare each path with float64 products and across batches), on
// 20,000 random trials per unit width of zeros, denormals, tiny normals, inf, NaN and
// ordinary values; then both timed on 128 x 3072. g++ -O3 -march=native -std=c++17.
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <random>
#include <cstdio>
#define GGUF_AVX512 1
namespace at { struct BFloat16 { uint16_t x; }; }
namespace pagedllm { inline __m512 load16(const at::BFloat16* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16)); } }
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
      if (top == 0.f || !finite) {
        std::memset(q, 0, width * sizeof(int16_t));
        xs[m * per_row + j] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
        xsum[m * per_row + j] = 0.f;
        continue;
      }
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
void quantize_rows256_ref(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t width,
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
      if (top == 0.f || !finite) {
        std::memset(q, 0, width * sizeof(int16_t));
        xs[m * per_row + j] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
        xsum[m * per_row + j] = 0.f;
        continue;
      }
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

int main() {
  std::mt19937 rng(7);
  const int64_t K = 256;
  long bad = 0, units = 0;
  for (int width : {16, 32})
  for (int trial = 0; trial < 20000; ++trial) {
    const int M = 3;
    std::vector<at::BFloat16> x(M * K);
    const int kind = trial % 8;
    for (auto& v : x) {
      uint32_t r = rng();
      uint16_t b = r >> 16;
      if (kind == 1) b &= 0x807F;                      // zeros and denormals
      if (kind == 2) b = (b & 0x8000) | (0x0080 + (r & 0x7F)); // tiny normals
      if (kind == 3 && (r & 255) == 0) b = 0x7F80;      // inf
      if (kind == 4 && (r & 255) == 0) b = 0x7FC1;      // nan
      if (kind == 5) b = (b & 0x80FF) | (((r >> 8) % 40 + 100) << 7); // ordinary
      if (kind == 6) b = 0;
      if (kind == 7) b = (b & 0x807F) | 0x3F80;          // around 1
      v.x = b;
    }
    std::vector<int16_t> q1(M * K), q2(M * K);
    std::vector<float> s1(M * K / width), s2(M * K / width), t1(M * K / width), t2(M * K / width);
    quantize_rows512(x.data(), K, M, K, width, q1.data(), s1.data(), t1.data());
    quantize_rows256_ref(x.data(), K, M, K, width, q2.data(), s2.data(), t2.data());
    units += M * K / width;
    if (memcmp(q1.data(), q2.data(), q1.size() * 2) || memcmp(s1.data(), s2.data(), s1.size() * 4) || memcmp(t1.data(), t2.data(), t1.size() * 4)) ++bad;
  }
  printf("trials with a difference: %ld (units %ld)\n", bad, units);
}
#include <chrono>
struct Bench { Bench() {
  const int64_t M = 128, K = 3072; std::vector<at::BFloat16> x(M * K); std::mt19937 rng(1);
  for (auto& v : x) v.x = 0x3F00 + (rng() & 0x1FF) | ((rng() & 1) << 15);
  std::vector<int16_t> q(M * K); std::vector<float> s(M * K / 32), t(M * K / 32);
  for (int f = 0; f < 2; ++f) { double best = 1e9; for (int r = 0; r < 50; ++r) { auto a = std::chrono::steady_clock::now();
    if (f) quantize_rows256_ref(x.data(), K, M, K, 32, q.data(), s.data(), t.data()); else quantize_rows512(x.data(), K, M, K, 32, q.data(), s.data(), t.data());
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count()); }
    printf("%s: %.0f us for 128 x 3072\n", f ? "256" : "512", best); } } } bench_;
