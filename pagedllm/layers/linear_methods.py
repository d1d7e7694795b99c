"""How a linear layer computes x w^T: one method object per weight format and kernel, chosen
once after the weights are loaded (in the spirit of vLLM's QuantizeMethodBase).

A method may keep another form of the weight in `layer.packed_weight` (process_weights_
after_loading) and then computes from it (apply). A layer holds its weight once: where the
packed form is all its kernels read, the plain `layer.weight` is freed (an empty tensor of
its dtype; tied embeddings share that Parameter, so the embedding is freed with it), and the
rare paths that need the plain matrix (an input not bf16 or not on the CPU) get it back from
`weight(layer)`, and an embedding tied to the layer takes its rows from `embedding(layer,
ids)`. Adding a format (GGUF Q8_0, Q4_K, ...) is one new class here plus the line in
select_linear_method or in the loader that picks it.

- TorchLinearMethod: F.linear. fp32 (so fp32 outputs stay HF transformers' bit for bit),
  CUDA, and layers not yet loaded.
- PackedBf16LinearMethod: pagedllm's packed bf16 kernel (csrc/packed_linear.cpp) at every
  row count, on CPUs with AVX512-BF16: dot products (AMD Zen 4/5), or AMX tiles on the
  same packing (Intel Xeon since Sapphire Rapids). Over SmolLM2's layers and head on the
  2-core Zen 5: 7.9 ms at 1 row (8.5 for the weight-streaming kernel, 12.8 for oneDNN),
  22.0 vs oneDNN's 27.0 at 32 rows, 41.1 vs 47.0 at 64, 2-5% faster at 512-2048.
- OneDNNLinearMethod: other bf16 CPU linears (shapes the packed kernel does not take):
  the weight-streaming kernel for few rows, the AMX kernel up to 32 rows, oneDNN on
  its prepacked weight beyond (torch's bf16 matmul reorders the weight on every call: with
  the packed copy a 64-row decode step takes 18 instead of 32 ms of linears). Where the
  CPU has AVX512-BF16, the first two kernels read the plain weight, so it stays beside
  oneDNN's packing: such linears hold their weight twice (see keeps_two_forms).
  Without AVX512-BF16 only oneDNN's packing is read and the plain weight is freed; where
  oneDNN cannot pack bf16 at all (AVX2-only CPUs: AMD Zen 2/3) it is F.linear.
- GGUFQ4_1LinearMethod (layers/quantized.py): a GGUF Q4_1 weight kept quantized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import ops, probes


class LinearMethod:
    """Computes a linear layer's x w^T (+ bias) from its weight."""

    # where the weight's packed form is pagedllm's own plain tensor (a oneDNN packing is
    # opaque memory no tensor of ours can hold)
    owns_packing = False
    kernel = "torch"  # what computes it, for the load log

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Prepare the loaded weight (pack it); by default nothing."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor,
                           silu_and_mul: nn.Module) -> torch.Tensor:
        """silu(gate) * up of a merged [gate; up] projection (no bias)."""
        return silu_and_mul.forward(self.apply(layer, x))

    def weight(self, layer: nn.Module) -> torch.Tensor:
        """The plain [N, K] weight, rebuilt from the packed form where it was freed (a
        temporary as large as the weight: for rare paths only)."""
        return layer.weight

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the weight: the lookup of an embedding tied to this layer."""
        return F.embedding(ids, self.weight(layer))


def _free_weight(layer: nn.Module) -> None:
    """Drop the plain weight's memory, the Parameter (and whatever shares it) kept: an empty
    tensor of its dtype, so that a use of it fails loudly instead of reading stale data."""
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)


def _is_freed(layer: nn.Module) -> bool:
    return layer.weight.numel() == 0 and layer.packed_weight is not None


class TorchLinearMethod(LinearMethod):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def _takes_cpu_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the 2-D [rows, K] the kernels take (a view where strides allow)."""
    return x.reshape(-1, x.shape[-1])


def takes_packed_bf16(weight: torch.Tensor) -> bool:
    """Whether a loaded bf16 CPU weight [..., N, K] (stacked experts too) takes pagedllm's
    packed kernel: built here (AVX512-BF16; on AMX CPUs it runs on AMX tiles where K is a
    multiple of 32), N a multiple of 16 and K even."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() >= 2 and probes.has_packed_linear()
            and weight.shape[-2] % 16 == 0 and weight.shape[-1] % 2 == 0)


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """A packing [..., N/16, K/2, 16, 2] (w[16a + c, 2b + d] at [a, b, c, d]) back to the
    weight [..., N, K], in a new tensor."""
    *lead, groups, pairs = packed.shape[:-2]
    return packed.transpose(-3, -2).reshape(*lead, groups * 16, pairs * 2)


class PackedBf16LinearMethod(LinearMethod):
    """fp32_out (the LM head): the kernel's fp32 sums, unrounded. Rounded to bf16 (a step of
    1/16 at 16), near-equal top logits would tie and the first index win.

    The packing [N/16, K/2, 16, 2] holds every element of the weight once, so it is the
    layer's only form: the plain weight is freed, and rebuilt or indexed from the packing."""

    owns_packing = True
    kernel = "pagedllm packed bf16"

    def __init__(self, fp32_out: bool = False) -> None:
        self.fp32_out = fp32_out

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if ops.packed_linear_uses_amx(layer.weight.shape[-1]):
            self.kernel = "pagedllm packed bf16 on AMX tiles"
        layer.packed_weight = ops.pack_linear_weight_bf16(layer.weight.detach())
        _free_weight(layer)

    def weight(self, layer: nn.Module) -> torch.Tensor:
        return unpack_bf16(layer.packed_weight)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        packed = layer.packed_weight
        flat = ids.reshape(-1)
        rows = packed[flat // 16, :, flat % 16]  # [ids, K/2, 2]
        return rows.reshape(*ids.shape, packed.shape[1] * 2)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or not x.is_cpu:
            return F.linear(x, self.weight(layer), bias)
        if x.dim() != 2:
            return self.apply(layer, _as_rows(x), bias).view(*x.shape[:-1], -1)
        y = ops.packed_linear_bf16(x, layer.packed_weight, self.fp32_out)
        return y if bias is None else y + bias

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor,
                           silu_and_mul: nn.Module) -> torch.Tensor:
        """In one pass, bit for bit the linear then SiLU-and-mul, without writing and
        re-reading the projection's output."""
        if not _takes_cpu_bf16(x):
            return silu_and_mul.forward(self.apply(layer, x))
        return ops.packed_gate_up_silu_bf16(x, layer.packed_weight)


class OneDNNLinearMethod(LinearMethod):
    kernel = "oneDNN bf16 (few rows: pagedllm's streaming/AMX kernels)"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = ops.onednn_pack_linear_weight(layer.weight)
        if layer.packed_weight is not None and not keeps_two_forms():
            _free_weight(layer)

    def weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.packed_weight.to_dense() if _is_freed(layer) else layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or not x.is_cpu:
            return F.linear(x, self.weight(layer), bias)
        if x.dim() != 2:
            return self.apply(layer, _as_rows(x), bias).view(*x.shape[:-1], -1)
        rows, weight = x.shape[0], layer.weight
        if probes.has_avx512_bf16() and weight.is_contiguous() and weight.numel():
            y = None
            if rows <= probes.small_linear_rows():
                y = ops.small_linear_bf16(x if x.stride(1) == 1 else x.contiguous(), weight)
            elif (rows <= probes.amx_linear_rows() and x.shape[1] % 32 == 0
                  and weight.shape[0] % 32 == 0):
                y = ops.amx_linear_bf16(x if x.stride(1) == 1 else x.contiguous(), weight)
            if y is not None:
                return y if bias is None else y + bias
        if layer.packed_weight is not None:
            return ops.onednn_linear(x, layer.packed_weight, bias)
        return F.linear(x, weight, bias)


def keeps_two_forms() -> bool:
    """Whether a oneDNN-packed linear keeps its plain weight too: on CPUs with AVX512-BF16,
    whose weight-streaming and AMX kernels read it for few rows (oneDNN's packing is opaque;
    no kernel of ours reads it). Such linears hold twice their bf16 bytes."""
    return probes.has_avx512_bf16()


def select_linear_method(weight: torch.Tensor, fp32_out: bool = False) -> LinearMethod:
    """The method for a loaded weight: pagedllm's packed bf16 kernel where it runs and takes
    the shape, else the oneDNN method for bf16 on the CPU, else F.linear."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return TorchLinearMethod()
    if takes_packed_bf16(weight):
        return PackedBf16LinearMethod(fp32_out)
    return OneDNNLinearMethod()
