"""Linear layers that know how tensor parallelism splits them (seed 002).

Column-parallel layers split the output features across ranks, row-parallel layers split
the input features and all-reduce the partial sums. With one rank they are plain linears.
Each weight carries a weight_loader that copies its rank's shard of a checkpoint tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import all_reduce, get_tp_rank, get_tp_size

# Up to this many rows, bf16 linears on CPUs with AVX512-BF16 but no AMX whose weight is
# not packed for pagedllm's kernel (prepack_weight) take pagedllm's weight-streaming kernel
# (csrc/small_linear.cpp), where oneDNN streams the weights slowly. Over SmolLM2's 30
# layers on the 2-core Zen 5: 7.9 vs 11.3 ms at 4 rows, 10.6 vs 15.9 at 8, 17.3 vs 18.7 at
# 16; on par at 24.
SMALL_LINEAR_MAX_ROWS = 16
# With AMX, up to this many rows (4-5x torch's speed at one row, on par at 4)...
SMALL_LINEAR_MAX_ROWS_AMX = 4
# ...and beyond that up to this many: pagedllm's AMX kernel on the plain weight
# (csrc/amx_linear.cpp), where oneDNN streams the weights at 13-16 GB/s. Over SmolLM2's
# layers: 9.8 vs 13.4 ms at 16 rows, 13 vs 15 at 32; oneDNN is faster from ~48.
AMX_LINEAR_MAX_ROWS = 32
_kernels: dict[str, object] = {}  # name -> the kernel once looked up, or False where none


def _kernel(name: str, available: str):
    kernel = _kernels.get(name)
    if kernel is None:
        from pagedllm import cpu_ops
        ext = cpu_ops.load()
        kernel = _kernels[name] = getattr(ext, name) if ext is not None and \
            getattr(ext, available)() else False
    return kernel


def _small_linear_kernel():
    return _kernel("small_linear_bf16", "has_small_linear_bf16")


def amx_linear_rows() -> int:
    """Up to how many rows bf16 linears take the AMX kernel (0: none here)."""
    return AMX_LINEAR_MAX_ROWS if _kernel("amx_linear_bf16", "amx_available") else 0


def small_linear_rows() -> int:
    """Up to how many rows bf16 linears take the weight-streaming kernel (where there is
    one: see _small_linear_kernel)."""
    return SMALL_LINEAR_MAX_ROWS_AMX if amx_linear_rows() else SMALL_LINEAR_MAX_ROWS


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed once for bf16 matmuls on CPU; None elsewhere (fp32 keeps F.linear,
    so that fp32 outputs stay exactly those of HF transformers).

    On CPUs with AVX512-BF16 but no AMX: packed for pagedllm's own kernel
    (csrc/packed_linear.cpp, a 4-D tensor), which then takes every row count. Over
    SmolLM2's layers and lm_head on the 2-core Zen 5: 7.9 ms at 1 row (8.5 for the
    weight-streaming kernel, 12.8 for oneDNN), 22.0 vs oneDNN's 27.0 at 32 rows, 41.1 vs
    47.0 at 64, 2-5% faster at 512-2048. Elsewhere (AMX, or a shape it does not take: N not
    a multiple of 16, K odd): oneDNN's blocked layout. torch's bf16 matmul reorders the
    weight on every call: with the packed copy a decode step of 64 rows takes 18 instead of
    32 ms of linears, a 2048-token prefill chunk 180 instead of 250 (same results)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    pack = _kernel("pack_linear_weight_bf16", "has_packed_linear_bf16")
    if pack and not amx_linear_rows() and n % 16 == 0 and k % 2 == 0:
        return pack(weight.detach())
    if not torch.backends.mkldnn.is_available():
        return None
    # The batch-size hint only picks a blocking; 64 gave results equal to F.linear's.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def is_packed_for_pagedllm(packed: torch.Tensor | None) -> bool:
    """Whether the packed weight is one of pagedllm's plain tensors: prepack_weight's for
    the bf16 kernel, or a GGUF Q4_1 weight (layers/quantized.py); else it is oneDNN's."""
    return packed is not None and packed.dim() == 4


def is_q4_1(packed: torch.Tensor | None) -> bool:
    """Whether a linear's packed weight is a GGUF Q4_1 weight (layers/quantized.py
    pack_q4_1; else bf16, oneDNN's, or none)."""
    return packed is not None and packed.dtype == torch.uint8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """F.linear; on CPU in bf16 a weight packed for pagedllm's kernel (prepack_weight)
    takes it at every row count; otherwise few rows (small_linear_rows) take the
    weight-streaming kernel, up to AMX_LINEAR_MAX_ROWS the AMX kernel where there is one,
    and more rows oneDNN on the prepacked weight, when given. A GGUF Q4_1 weight kept
    quantized (layers/quantized.py) takes its kernel at every row count. fp32_out (logits):
    pagedllm's bf16 kernel returns its fp32 sums unrounded; other paths return x's dtype."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu:
        if is_packed_for_pagedllm(packed):
            if is_q4_1(packed):
                y = _kernel("q4_1_linear_bf16", "has_packed_linear_bf16")(x, packed)
            else:
                y = _kernel("packed_linear_bf16", "has_packed_linear_bf16")(x, packed, fp32_out)
            return y if bias is None else y + bias
        rows = x.shape[0]
        if weight.dtype == torch.bfloat16 and weight.is_contiguous():
            kernel = None
            if rows <= small_linear_rows():
                kernel = _small_linear_kernel()
            elif (rows <= amx_linear_rows() and x.shape[1] % 32 == 0
                  and weight.shape[0] % 32 == 0):
                kernel = _kernel("amx_linear_bf16", "amx_available")
            if kernel:
                y = kernel(x if x.stride(1) == 1 else x.contiguous(), weight)
                return y if bias is None else y + bias
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def gate_up_silu(x: torch.Tensor, gate_up: LinearBase) -> torch.Tensor | None:
    """silu(gate) * up of a merged [gate; up] projection in one pass, where its weight is
    packed for pagedllm's kernel (bf16 on CPU, no bias): the results of the linear followed
    by SiLU-and-mul (layers/activation.py), bit for bit, without writing and re-reading the
    projection's output. None elsewhere."""
    packed = gate_up.packed_weight
    if (not is_packed_for_pagedllm(packed) or is_q4_1(packed)
            or gate_up.bias is not None or x.dim() != 2
            or x.dtype != torch.bfloat16 or not x.is_cpu):
        return None
    return _kernel("packed_gate_up_silu_bf16", "has_packed_linear_bf16")(x, packed)


class PrepackedWeight:
    """Mixin of the modules whose 2-D `weight` feeds linear(): after loading, prepack()
    may keep a packed copy of it (see prepack_weight)."""

    packed_weight: torch.Tensor | None = None

    def prepack(self) -> int:
        """Pack the loaded weight where that applies; the bytes it added."""
        self.packed_weight = prepack_weight(self.weight)  # type: ignore[attr-defined]
        return 0 if self.packed_weight is None else self.weight.nbytes  # type: ignore[attr-defined]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(PrepackedWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        assert out_features % get_tp_size() == 0
        super().__init__(in_features, out_features // get_tp_size(), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix, e.g. gate and up projections."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        (index,) = shard
        tp = self.tp_size
        offset = sum(self.output_sizes[:index]) // tp
        size = self.output_sizes[index] // tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q, k and v projections; heads split across ranks (KV heads replicated when
    there are fewer of them than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_size()
        assert num_heads % tp == 0
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        (which,) = shard
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if which == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if which == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed by all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        assert in_features % get_tp_size() == 0
        super().__init__(in_features // get_tp_size(), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        if param.dim() == 1:  # the bias is added once, on every rank after the reduce
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, packed=self.packed_weight)
        if self.tp_size > 1:
            all_reduce(y)
        return y + self.bias if self.bias is not None else y
