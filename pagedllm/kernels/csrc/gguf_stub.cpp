// TEMPORARY STUB, not to be committed
#include "ops.h"
namespace pagedllm {
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& out, bool fp32_out) {
  TORCH_CHECK(false, "stub");
}
}
