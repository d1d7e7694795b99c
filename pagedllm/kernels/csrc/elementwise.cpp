// Fused elementwise ops of the decoder layer, so that a decode step runs a few C++ loops per
// layer instead of a dozen small torch ops (each a dispatch, an allocation and a pass over
// memory). Each one computes what the torch code it replaces computes, rounding to the
// activation dtype at the same points (the file is built with -ffp-contract=off, so no
// multiply-add is fused behind our back): RMSNorm with the residual add (Llama's, or
// Gemma's scaling by 1 + weight), SiLU(gate) * up,
// the rotary embedding, and the greedy argmax of the sampler.
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }
// Round to T and back: the value torch stores after an op in dtype T.
template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }

// Rows of work per task: enough elements that a task outweighs the cost of handing it out.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / row_elems); }

#if PAGEDLLM_VEC_WIDTH > 0
namespace vec = pagedllm::vec;
constexpr int64_t W = vec::kWidth;
#endif

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, bool unit_offset, at::Tensor& out, at::Tensor* new_residual) {
  const int64_t rows = x.size(0), d = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* np = new_residual ? new_residual->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      const T* rr = rp ? rp + r * rs : nullptr;
      T* nr = np ? np + r * d : nullptr;
      T* o = op + r * d;
      float ss = 0.f;
      int64_t i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
      vec::V acc = vec::zero();
      for (; i + W <= d; i += W) {
        vec::V v = vec::load(xr + i);
        if (rr) {  // x + residual, stored in T (torch: x = x + residual)
          v = vec::round<T>(vec::add(v, vec::load(rr + i)));
          vec::store(nr + i, v);
        }
        vec::store(h.data() + i, v);
        acc = vec::add(acc, vec::mul(v, v));
      }
      ss = vec::reduce_add(acc);
#endif
      for (; i < d; ++i) {
        float v = f32(xr[i]);
        if (rr) {
          v = rnd<T>(v + f32(rr[i]));
          nr[i] = static_cast<T>(v);
        }
        h[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
      i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
      const vec::V iv = vec::set1(inv), one = vec::set1(1.f);
      if (unit_offset) {  // ((x * rsqrt(mean(x^2) + eps)) * (1 + weight)).to(T), all in fp32
        for (; i + W <= d; i += W)
          vec::store(o + i, vec::mul(vec::mul(vec::load(h.data() + i), iv),
                                     vec::add(one, vec::load(wp + i))));
      } else {  // weight * (x * rsqrt(mean(x^2) + eps)).to(T)
        for (; i + W <= d; i += W)
          vec::store(o + i, vec::mul(vec::load(wp + i),
                                     vec::round<T>(vec::mul(vec::load(h.data() + i), iv))));
      }
#endif
      for (; i < d; ++i)
        o[i] = static_cast<T>(unit_offset ? h[i] * inv * (1.f + f32(wp[i]))
                                          : f32(wp[i]) * rnd<T>(h[i] * inv));
    }
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = out.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + d;
      T* o = op + r * d;
      int64_t i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
      for (; i + W <= d; i += W) {  // silu(g) = g / (1 + e^-g) stored in T, times up
        const vec::V gv = vec::load(g + i);
        const vec::V e = vec::exp(vec::sub(vec::zero(), gv));
        const vec::V s = vec::round<T>(vec::div(gv, vec::add(vec::set1(1.f), e)));
        vec::store(o + i, vec::mul(s, vec::load(u + i)));
      }
#endif
      for (; i < d; ++i) {
        const float gi = f32(g[i]);
        o[i] = static_cast<T>(rnd<T>(gi / (1.f + std::exp(-gi))) * f32(u[i]));
      }
    }
  });
}

// x [T, heads, D] (any strides but a contiguous D) rotated in place, half-rotation layout:
// x * cos + rotate_half(x) * sin, with cos/sin [max_pos, D] (fp32) rounded to T first.
template <typename T>
void rotary_rows(const at::Tensor& positions, at::Tensor& x, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    std::vector<float> c(d), s(d), v(d);
    for (int64_t t = begin; t < end; ++t) {
      int64_t i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
      for (; i + W <= d; i += W) {
        vec::store(&c[i], vec::round<T>(vec::load(cp + pos[t] * d + i)));
        vec::store(&s[i], vec::round<T>(vec::load(sp + pos[t] * d + i)));
      }
#endif
      for (; i < d; ++i) {
        c[i] = rnd<T>(cp[pos[t] * d + i]);
        s[i] = rnd<T>(sp[pos[t] * d + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + t * ts + h * hs;
        i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
        for (; i + W <= half; i += W) {  // both halves' W lanes at a time
          const vec::V lo = vec::load(row + i), hi = vec::load(row + half + i);
          const vec::V lo_out = vec::add(
              vec::round<T>(vec::mul(lo, vec::load(&c[i]))),
              vec::round<T>(vec::mul(vec::sub(vec::zero(), hi), vec::load(&s[i]))));
          const vec::V hi_out = vec::add(
              vec::round<T>(vec::mul(hi, vec::load(&c[half + i]))),
              vec::round<T>(vec::mul(lo, vec::load(&s[half + i]))));
          vec::store(row + i, lo_out);
          vec::store(row + half + i, hi_out);
        }
#endif
        if (i < half) {  // what the vectors did not cover (half not a multiple of W)
          for (int64_t j = 0; j < d; ++j) v[j] = f32(row[j]);
          for (; i < half; ++i) {
            row[i] = static_cast<T>(rnd<T>(v[i] * c[i]) + rnd<T>(-v[i + half] * s[i]));
            row[half + i] = static_cast<T>(rnd<T>(v[half + i] * c[half + i]) +
                                           rnd<T>(v[i] * s[half + i]));
          }
        }
      }
    }
  });
}

}  // namespace

namespace pagedllm {

#define PAGEDLLM_DISPATCH_FLOAT(dtype, NAME, ...)                                        \
  switch (dtype) {                                                                        \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }                        \
    case at::kBFloat16: { using scalar = at::BFloat16; __VA_ARGS__; break; }              \
    case at::kHalf: { using scalar = at::Half; __VA_ARGS__; break; }                      \
    default: TORCH_CHECK(false, NAME " supports float32, bfloat16 and float16, got ", dtype); \
  }

std::string elementwise_isa() {
  return PAGEDLLM_VEC_WIDTH == 16 ? "avx512" : PAGEDLLM_VEC_WIDTH == 8 ? "avx2" : "scalar";
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, D] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [D], contiguous, in x's dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be like x");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor new_residual = residual ? at::empty(x.sizes(), x.options()) : at::Tensor();
  PAGEDLLM_DISPATCH_FLOAT(x.scalar_type(), "rms_norm",
                          rms_norm_rows<scalar>(x, residual ? &*residual : nullptr, weight, eps,
                                                unit_offset, out,
                                                residual ? &new_residual : nullptr));
  if (residual) return {out, new_residual};
  return {out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be [T, 2 * I] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  PAGEDLLM_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", silu_and_mul_rows<scalar>(x, out));
  return out;
}

void rotary_embedding(const at::Tensor& positions, at::Tensor x, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be [T, heads, D] with a contiguous, even D");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == x.size(0),
              "positions must be int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(1) == x.size(2),
              "cos and sin must be float32 [max_position, D]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t],
                " out of the rotary cache's range");
  PAGEDLLM_DISPATCH_FLOAT(x.scalar_type(), "rotary_embedding",
                          rotary_rows<scalar>(positions, x, cos, sin));
}

}  // namespace pagedllm

namespace {

// Index of the largest of row[0:v], the first one on ties, NaN counting as largest (as
// torch.argmax). Widening bf16 / fp16 to fp32 is exact, so the order is the same.
template <typename T>
int64_t argmax_row(const T* row, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
  namespace vec = pagedllm::vec;
  vec::V mv = vec::set1(m);
  for (; i + vec::kWidth <= v; i += vec::kWidth) {
    const vec::V x = vec::load(row + i);
    nan |= vec::any_nan(x);
    mv = vec::max(mv, x);
  }
  m = vec::reduce_max(mv);
#endif
  for (; i < v; ++i) {
    const float x = static_cast<float>(row[i]);
    m = x > m ? x : m;
    nan |= x != x;
  }
  i = 0;
#if PAGEDLLM_VEC_WIDTH > 0
  if (!nan) {  // the first position equal to the maximum
    const vec::V target = vec::set1(m);
    for (; i + vec::kWidth <= v; i += vec::kWidth)
      if (vec::any_equal(vec::load(row + i), target)) break;
  }
#endif
  for (; i < v; ++i) {
    const float x = static_cast<float>(row[i]);
    if (nan ? x != x : x == m) return i;
  }
  return 0;
}

}  // namespace

namespace pagedllm {

// Index of each row's largest value (argmax_row), for float32, bfloat16 and float16 logits:
// torch's own takes 3.5 ms for 64 rows of a 49k vocabulary here, and greedy sampling of
// bf16 logits need not widen them all to fp32 first (2.3 ms more at 64 rows).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [B, V] with contiguous rows");
  const int64_t rows = x.size(0), v = x.size(1), xs = x.stride(0);
  TORCH_CHECK(v > 0, "argmax of an empty row");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  PAGEDLLM_DISPATCH_FLOAT(x.scalar_type(), "argmax_rows", {
    const scalar* xp = x.data_ptr<scalar>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, v);
    });
  });
  return out;
}

// Grammar masks applied in place: logits[rows[i], t] = -inf where bit t % 32 of word t / 32
// of masks[i] is 0. A grammar's mask is mostly whole words of one kind (the tokens it
// allows are few, or all but a few), so each word is skipped (all allowed), filled (none)
// or taken bit by bit without branches; torch.where over the unpacked bools branches on
// every element (2 ms for 16 rows of a 49k vocabulary of random bits).
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& masks, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t vocab = logits.size(1), words = (vocab + 31) / 32;
  TORCH_CHECK(masks.dim() == 2 && masks.scalar_type() == at::kInt && masks.is_contiguous() &&
                  masks.size(1) >= words,
              "masks must be contiguous int32 [M, ceil(V / 32)]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.size(0) == masks.size(0),
              "rows must be int64 [M]");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(0 <= row[i] && row[i] < logits.size(0), "row ", row[i], " out of range");
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0), ms = masks.size(1);
  const float neg = -std::numeric_limits<float>::infinity();
  uint32_t neg_bits;
  std::memcpy(&neg_bits, &neg, sizeof(neg_bits));
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* x = lp + row[i] * ls;
      const uint32_t* m = mp + i * ms;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t n = std::min<int64_t>(32, vocab - 32 * w);
        float* xw = x + 32 * w;
        if (bits == 0) {
          std::fill_n(xw, n, neg);
          continue;
        }
        uint32_t* xb = reinterpret_cast<uint32_t*>(xw);  // a select on the bits: vectorises
        for (int64_t b = 0; b < n; ++b) {
          const uint32_t keep = 0u - ((bits >> b) & 1u);
          xb[b] = (xb[b] & keep) | (neg_bits & ~keep);
        }
      }
    }
  });
}

}  // namespace pagedllm
