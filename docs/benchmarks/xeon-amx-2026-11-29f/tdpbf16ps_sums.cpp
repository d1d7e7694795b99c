#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
static float bf(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; memcpy(&f, &u, 4); return f; }
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct alignas(64) { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; } c;
  for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
  std::mt19937 rng(1);
  alignas(64) static uint16_t A[16][32], B[16][32]; alignas(64) static float C[16][16], R[16][16];
  long bad[4] = {0, 0, 0, 0}, total = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::normal_distribution<float> nd(0, 1);
    for (int i = 0; i < 16; ++i) for (int k = 0; k < 32; ++k) { float f = nd(rng) * (trial % 3 == 0 ? 1000 : 1); uint32_t u; memcpy(&u, &f, 4); A[i][k] = u >> 16; }
    for (int k = 0; k < 16; ++k) for (int n = 0; n < 32; ++n) { B[k][n] = 0x4300 | (rng() & 15); if (trial % 2) { float f = nd(rng); uint32_t u; memcpy(&u, &f, 4); B[k][n] = u >> 16; } }
    for (int i = 0; i < 16; ++i) for (int n = 0; n < 16; ++n) C[i][n] = (trial % 4 == 0) ? 0.f : nd(rng) * 100;
    _tile_loadd(0, C, 64); _tile_loadd(4, A, 64); _tile_loadd(5, B, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_stored(0, R, 64);
    for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) {
      float E = 0, O = 0, s1 = C[m][n], s2 = C[m][n], P;
      for (int k = 0; k < 16; ++k) { E += bf(A[m][2*k]) * bf(B[k][2*n]); O += bf(A[m][2*k+1]) * bf(B[k][2*n+1]); }
      for (int k = 0; k < 16; ++k) { s1 += bf(A[m][2*k]) * bf(B[k][2*n]); s1 += bf(A[m][2*k+1]) * bf(B[k][2*n+1]); }
      for (int k = 0; k < 16; ++k) { s2 = s2 + (bf(A[m][2*k]) * bf(B[k][2*n]) + bf(A[m][2*k+1]) * bf(B[k][2*n+1])); }
      float c1 = C[m][n] + (E + O);
      float c2 = (C[m][n] + E) + O;
      float got = R[m][n];
      bad[0] += got != c1; bad[1] += got != c2; bad[2] += got != s1; bad[3] += got != s2; total++;
    }
  }
  printf("total %ld: c+(E+O) %ld, (c+E)+O %ld, seq %ld, pairsum %ld\n", total, bad[0], bad[1], bad[2], bad[3]);
  _tile_release();
}
