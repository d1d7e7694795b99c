#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &pagedllm::paged_attention,
        "out[rows' tokens] = causal attention of q over the paged K/V cache (in place)");
  m.def("small_linear_bf16", &pagedllm::small_linear_bf16,
        "x w^T for a few bf16 rows x, streaming the bf16 weight w once");
  m.def("has_small_linear_bf16", &pagedllm::has_small_linear_bf16,
        "whether this build has the AVX512-BF16 small-batch linear");
}
