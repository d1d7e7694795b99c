// What the AMX kernels share: the build check, the process's permission, the tile layout;
// and what the attention kernels' AVX512-BF16 path shares with them (PAGEDLLM_BF16_DOT,
// transpose16x16).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm {

// Linux hands out the AMX tile state only to processes that ask for it.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tile t as rows[t] rows of bytes[t] bytes. Each thread configures its tiles before use
// (and releases them after).
inline void configure_tiles(const uint8_t (&rows)[8], const uint16_t (&bytes)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = bytes[t];
    config.rows[t] = rows[t];
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without this barrier the
  // stores to the rest of the 64 may be dropped (seen: only the palette stored, LDTILECFG
  // faulting on the stack's garbage).
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Eight tiles of 16 rows x 64 bytes: 16 x 32 bf16 operands, 16 x 16 fp32 accumulators.
inline void configure_tiles() {
  configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}, {64, 64, 64, 64, 64, 64, 64, 64});
}

}  // namespace pagedllm

#endif  // PAGEDLLM_AMX

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The attention kernels of prompt_attention.cpp also run without AMX, on AVX512-BF16 dot
// products (e.g. AMD Zen 4 and 5).
#define PAGEDLLM_BF16_DOT 1
#include <immintrin.h>

namespace pagedllm {

// A 16 x 16 matrix of 32-bit elements, one row per vector, transposed in place.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + w]: column 4b + w of rows 4i.. in 128-bit lane b
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {  // r[c]: column c
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

}  // namespace pagedllm

#endif  // PAGEDLLM_BF16_DOT

namespace pagedllm {

// Whether this build and CPU run the AMX kernels (prompt_attention.cpp, amx_linear.cpp).
inline bool amx_available() {
#if defined(PAGEDLLM_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace pagedllm
