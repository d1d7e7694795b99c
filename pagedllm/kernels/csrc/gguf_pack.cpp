// GGUF blocks rearranged into gguf_linear.cpp's layout (described in its header): the
// loader's step between the file and the kernel. One pass over the rows, threads over
// panels; each output's bytes land where its group's words and headers are, so no two
// threads write the same byte. The blocks' fields are copied, never converted: the packed
// weight has exactly the file's values.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace pagedllm {
namespace {

constexpr int64_t kGroup = 16, kPanelGroups = 4, kUnitInputs = 32;

struct Layout {
  int64_t block, type_size, header, unit;  // inputs and bytes per GGUF block; packed bytes
};

Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case 2: return {32, 18, 32, 256};     // Q4_0
    case 3: return {32, 20, 64, 256};     // Q4_1
    case 8: return {32, 34, 32, 512};     // Q8_0
    case 12: return {256, 144, 320, 256};  // Q4_K
    case 13: return {256, 176, 320, 320};  // Q5_K
    case 14: return {256, 210, 288, 384};  // Q6_K
    default: TORCH_CHECK(false, "gguf_pack: unsupported ggml type ", qtype);
  }
}

// The block's quants (0..63 for the 4-6 bit types, the int8 byte for Q8_0) in input order.
void block_quants(int64_t qtype, const uint8_t* b, uint8_t* q) {
  switch (qtype) {
    case 2: case 3: {
      const uint8_t* qs = b + (qtype == 2 ? 2 : 4);
      for (int x = 0; x < 16; ++x) q[x] = qs[x] & 0x0F, q[x + 16] = qs[x] >> 4;
      break;
    }
    case 8: std::memcpy(q, b + 2, 32); break;
    case 12: case 13: {  // 4 runs of 32 bytes: low nibbles (64 r + l), then high (+ 32)
      const uint8_t* qs = b + (qtype == 12 ? 16 : 48);
      for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 32; ++l) {
          q[64 * r + l] = qs[32 * r + l] & 0x0F;
          q[64 * r + 32 + l] = qs[32 * r + l] >> 4;
        }
      if (qtype == 13)  // qh: bit i of byte l is bit 4 of input 32 i + l
        for (int i = 0; i < 8; ++i)
          for (int l = 0; l < 32; ++l) q[32 * i + l] |= ((b[16 + l] >> i) & 1) << 4;
      break;
    }
    case 14: {  // ql: 2 runs of 64 bytes (low, high nibbles); qh: 2 runs of 32 (4 crumbs)
      const uint8_t *ql = b, *qh = b + 128;
      for (int r = 0; r < 2; ++r) {
        for (int l = 0; l < 64; ++l) {
          q[128 * r + l] = ql[64 * r + l] & 0x0F;
          q[128 * r + 64 + l] = ql[64 * r + l] >> 4;
        }
        for (int i = 0; i < 4; ++i)
          for (int l = 0; l < 32; ++l)
            q[128 * r + 32 * i + l] |= ((qh[32 * r + l] >> (2 * i)) & 3) << 4;
      }
      break;
    }
  }
}

// One output's header fields into its group's header (16 outputs side by side per field).
void put_header(int64_t qtype, const uint8_t* b, int64_t lane, uint8_t* h) {
  auto fp16 = [&](int64_t field, const uint8_t* value) { std::memcpy(h + field + 2 * lane, value, 2); };
  auto byte = [&](int64_t field, int64_t j, uint8_t value) { h[field + 16 * j + lane] = value; };
  switch (qtype) {
    case 2: case 8: fp16(0, b); break;
    case 3: fp16(0, b), fp16(32, b + 2); break;
    case 12: case 13: {  // d, dmin, the 8 6-bit scales and mins as bytes
      fp16(0, b), fp16(32, b + 2);
      const uint8_t *a = b + 4, *m = b + 8, *c = b + 12;
      for (int j = 0; j < 4; ++j) {
        byte(64, j, a[j] & 0x3F), byte(64, j + 4, (c[j] & 0x0F) | ((a[j] >> 2) & 0x30));
        byte(192, j, m[j] & 0x3F), byte(192, j + 4, (c[j] >> 4) | ((m[j] >> 2) & 0x30));
      }
      break;
    }
    case 14:  // d, the 16 int8 scales
      fp16(0, b + 208);
      for (int j = 0; j < 16; ++j) byte(32, j, b[192 + j]);
      break;
  }
}

// One output's quants of one 32-input unit into its group's unit: pair p = 4 u + s of the
// unit is inputs 2 p, 2 p + 1 (elements e = 0, 1); each 16-bit word is written once.
void put_unit(int64_t qtype, const uint8_t* q, int64_t lane, uint8_t* unit) {
  auto word = [&](int64_t at, int64_t e) {  // the 16-bit word 2 lane + e of a run at `at`
    return reinterpret_cast<uint16_t*>(unit + at) + 2 * lane + e;
  };
  if (qtype == 8) {
    for (int p = 0; p < 16; ++p) std::memcpy(unit + p * 32 + 2 * lane, q + 2 * p, 2);
    return;
  }
  for (int e = 0; e < 2; ++e) {
    for (int u = 0; u < 4; ++u) {
      uint16_t w = 0;
      for (int s = 0; s < 4; ++s) w |= static_cast<uint16_t>((q[2 * (4 * u + s) + e] & 0x0F) << (4 * s));
      *word(u * 64, e) = w;
    }
    if (qtype == 13) {
      uint16_t w = 0;
      for (int p = 0; p < 16; ++p) w |= static_cast<uint16_t>(((q[2 * p + e] >> 4) & 1) << p);
      *word(256, e) = w;
    }
    if (qtype == 14)
      for (int v = 0; v < 2; ++v) {
        uint16_t w = 0;
        for (int j = 0; j < 8; ++j)
          w |= static_cast<uint16_t>(((q[2 * (8 * v + j) + e] >> 4) & 3) << (2 * j));
        *word(256 + v * 64, e) = w;
      }
  }
}

}  // namespace

at::Tensor gguf_pack(const at::Tensor& raw, int64_t qtype, int64_t n, int64_t k) {
  const Layout f = layout_of(qtype);
  TORCH_CHECK(n > 0 && k > 0 && k % f.block == 0, "gguf_pack: K must be a positive multiple of ",
              f.block);
  const int64_t blocks = k / f.block, row_bytes = blocks * f.type_size;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(0) == n &&
                  raw.size(1) == row_bytes && raw.is_contiguous(),
              "gguf_pack: raw must be contiguous uint8 [", n, ", ", row_bytes, "]");
  const int64_t groups = (n + 2 * kGroup - 1) / (2 * kGroup) * 2;
  const int64_t panels = (groups + kPanelGroups - 1) / kPanelGroups;
  const int64_t units = f.block / kUnitInputs, group_block = f.header + units * f.unit;
  const int64_t panel_bytes = blocks * kPanelGroups * group_block;
  // (padding outputs keep all-zero blocks: weight 0)
  at::Tensor out = at::zeros({groups * blocks * group_block}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(f.block);
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t G = std::min(kPanelGroups, groups - panel * kPanelGroups);
      const int64_t first = panel * kPanelGroups * kGroup;
      for (int64_t o = first; o < std::min(n, first + G * kGroup); ++o) {
        const int64_t g = (o - first) / kGroup, lane = o % kGroup;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* blk = src + o * row_bytes + b * f.type_size;
          uint8_t* packed = dst + panel * panel_bytes + b * G * group_block;
          put_header(qtype, blk, lane, packed + g * f.header);
          block_quants(qtype, blk, q.data());
          for (int64_t i = 0; i < units; ++i)
            put_unit(qtype, q.data() + i * kUnitInputs, lane,
                     packed + G * f.header + (i * G + g) * f.unit);
        }
      }
    }
  });
  return out;
}

}  // namespace pagedllm
