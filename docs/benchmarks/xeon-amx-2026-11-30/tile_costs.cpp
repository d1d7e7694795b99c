#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
#include "amx.h"
// ns per TDPBF16PS in a loop of independent accumulators, tiles of `rows` rows
double bench(int64_t rows, int64_t iters, int64_t mode) {
  TORCH_CHECK(pagedllm::amx_available());
  uint8_t r = rows;
  pagedllm::configure_tiles({r, 16, 16, 16, r, r, r, r}, {64, 64, 64, 64, 64, 64, 64, 64});
  alignas(64) static uint16_t a[16 * 32], b[16 * 32 * 4];
  alignas(64) static float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = 0x3f80;
  for (int i = 0; i < 16 * 32 * 4; ++i) b[i] = 0x3f80;
  _tile_loadd(0, a, 64); _tile_loadd(1, b, 64); _tile_loadd(2, b + 512, 64); _tile_loadd(3, b + 1024, 64);
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    if (mode == 0) {
      _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(5, 0, 2); _tile_dpbf16ps(6, 0, 3); _tile_dpbf16ps(7, 0, 1);
    } else {  // with a B load from memory and a C store per product, as a one-row step would
      _tile_loadd(1, b + (i % 4) * 512, 64); _tile_zero(4); _tile_dpbf16ps(4, 0, 1); _tile_stored(4, c, 64);
      _tile_loadd(2, b + ((i + 1) % 4) * 512, 64); _tile_zero(5); _tile_dpbf16ps(5, 0, 2); _tile_stored(5, c + 16, 64);
      _tile_loadd(3, b + ((i + 2) % 4) * 512, 64); _tile_zero(6); _tile_dpbf16ps(6, 0, 3); _tile_stored(6, c + 32, 64);
      _tile_loadd(1, b + ((i + 3) % 4) * 512, 64); _tile_zero(7); _tile_dpbf16ps(7, 0, 1); _tile_stored(7, c + 48, 64);
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  _tile_release();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (iters * 4);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bench", &bench); }
