// 1-row tile pipeline microbench over a Q4_K-like stream of units (2 groups a unit)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
inline __m512i decode(const uint8_t* unit, int u, int s) {
  const __m512i words = _mm512_loadu_si512(unit + u * 64);
  return _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4 * s), _mm512_set1_epi16(0x0F), _mm512_set1_epi16(0x4300), 0xEA);
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int mode = atoi(argv[1]), D = atoi(argv[2]);
  struct alignas(64) { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; } c;
  for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = t < 6 ? 1 : 16; }
  _tile_loadconfig(&c);
  const int units = 6144 / 32 * 1024 / 32;  // unit-group pairs of a 6144 x 1024 half: 6144 unit-groups per core
  std::vector<uint8_t> w(units * 512 + 4096);
  for (auto& v : w) v = rand();
  alignas(64) static uint16_t qb[8][2][512]; alignas(64) static float cb[4][2][16]; alignas(64) static uint16_t x[64];
  for (int i = 0; i < 64; ++i) x[i] = 0x3f80;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  double best = 1e9;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    _tile_loadd(4, x, 64);
    for (int u = 0; u < units + D; ++u) {
      if (u < units) {
        const uint8_t* un = w.data() + u * 512;
        for (int g = 0; g < 2; ++g)
          for (int p = 0; p < 16; ++p) _mm512_store_si512(qb[u % 8][g] + p * 32, decode(un + g * 256, p / 4, p % 4));
      }
      if (mode >= 1 && u >= D) {
        const int v = u - D;
        if (v % 2 == 0) { _tile_loadd(6, qb[v % 8][0], 64); _tile_loadd(7, qb[v % 8][1], 64); }
        else { _tile_loadd(6, qb[v % 8][0], 64); _tile_loadd(7, qb[v % 8][1], 64); }
        if (mode >= 2) {
          if (v % 2 == 0) { _tile_zero(0); _tile_dpbf16ps(0, 4, 6); _tile_zero(1); _tile_dpbf16ps(1, 4, 7); }
          else { _tile_zero(2); _tile_dpbf16ps(2, 4, 6); _tile_zero(3); _tile_dpbf16ps(3, 4, 7); }
        }
        if (mode >= 3 && v >= 1) {
          const int pv = v - 1;
          if (pv % 2 == 0) { _tile_stored(0, cb[pv % 4][0], 64); _tile_stored(1, cb[pv % 4][1], 64); }
          else { _tile_stored(2, cb[pv % 4][0], 64); _tile_stored(3, cb[pv % 4][1], 64); }
        }
        if (mode >= 4 && v >= 2) {
          const int pv = v - 2;
          acc0 = _mm512_fmadd_ps(_mm512_load_ps(cb[pv % 4][0]), acc1, acc0);
          acc1 = _mm512_fmadd_ps(_mm512_load_ps(cb[pv % 4][1]), acc0, acc1);
        }
      }
    }
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  float o[16]; _mm512_storeu_ps(o, _mm512_add_ps(acc0, acc1));
  printf("mode %d D %d: %.1f ns per unit (2 groups)  [%g]\n", mode, D, best / units, o[0]);
  _tile_release();
}
