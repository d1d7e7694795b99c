#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <x86intrin.h>
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct alignas(64) { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; } c;
  for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
  alignas(64) static uint16_t a[16*32*4], b[16*32*4]; alignas(64) static float cb[4][256];
  for (int i = 0; i < 16*32*4; ++i) a[i] = b[i] = 0x3f80;
  _tile_loadd(4, a, 64); _tile_loadd(5, b, 64); _tile_loadd(6, a+512, 64); _tile_loadd(7, b+512, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int n = 1000000;
  auto t = std::chrono::steady_clock::now(); uint64_t c0 = __rdtsc();
  for (int i = 0; i < n; ++i) { _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 6, 5); _tile_dpbf16ps(3, 6, 7); }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  printf("TDPBF16PS: %.2f ns each, %.1f tsc each\n", ns / (4.0 * n), (__rdtsc() - c0) / (4.0 * n));
  t = std::chrono::steady_clock::now(); c0 = __rdtsc();
  for (int i = 0; i < n; ++i) { _tile_dpbusd(0, 4, 5); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 6, 5); _tile_dpbusd(3, 6, 7); }
  ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  printf("TDPBUSD: %.2f ns each, %.1f tsc each\n", ns / (4.0 * n), (__rdtsc() - c0) / (4.0 * n));
  t = std::chrono::steady_clock::now(); c0 = __rdtsc();
  for (int i = 0; i < n; ++i) { _tile_dpbf16ps(0, 4, 5); _tile_stored(0, cb[0], 64); }
  ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  printf("TDP+store dependent: %.2f ns each\n", ns / n);
  t = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) { _tile_stored(0, cb[i&3], 64); }
  ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  printf("store: %.2f ns each\n", ns / n);
  t = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) { _tile_loadd(4, a + (i & 3) * 512, 64); _tile_dpbf16ps(0, 4, 5);}
  ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
  printf("load+TDP: %.2f ns each\n", ns / n);
  _tile_release();
}
