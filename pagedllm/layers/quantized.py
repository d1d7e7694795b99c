"""GGUF weights kept as the file stores them (quantization="gguf"), for the CPU kernel
csrc/gguf_linear.cpp: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K, which cover the Q4_0, Q4_K_M,
Q5_K_M, Q6_K and Q8_0 files users download.

The kernel computes with the weights' exact values (those HF transformers and llama.cpp
dequantize) from bf16 activations, reading 4.5-8.5 bits a weight where bf16 weights take
16. Each weight is held once: its packed form (layers/gguf_packing.py, at most ~1.1x the
file's bytes) replaces the bf16 weight the layer was built with, which is never filled.

A merged linear (q/k/v, gate/up) takes its checkpoint tensors one by one through its own
weight_loader, into one byte matrix per type. Where they all have one type they are packed
as one weight; a Q4_K_M file stores some layers' v projection as Q6_K beside Q4_K q and k,
and then each run of rows of one type is packed on its own and computed into its columns
of the output. A linear with a part the kernel does not take is dequantized whole.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import gguf
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.kernels import ops
from pagedllm.layers.gguf_packing import can_pack, dequantize_packed_rows, pack_gguf
from pagedllm.layers.linear_methods import LinearMethod

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFWeight:
    """A 2-D quantized weight [rows, cols] in HF row order: `data` is uint8 [rows, bytes per
    row], each row its cols / block_size blocks as in the file. It splits by rows the way a
    tensor does (split, chunk), so model code that cuts a fused checkpoint
    tensor into its parts (Phi-3's qkv) cuts it as well; `dequantize` gives the weight."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def _rows(self, start: int, length: int) -> GGUFWeight:
        return GGUFWeight(self.qtype, self.data[start:start + length], self.cols)

    def split(self, sizes: list[int]) -> list[GGUFWeight]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self._rows(s, n) for s, n in zip(starts, sizes)]

    def chunk(self, chunks: int) -> list[GGUFWeight]:
        return self.split([self.data.shape[0] // chunks] * chunks)

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 [rows, cols]."""
        # (the gguf package's reference dequantization: this is the rare path of a weight
        # that cannot stay quantized; the loader's faster one imports the layers)
        values = gguf.quants.dequantize(self.data.numpy(), self.qtype)
        return torch.from_numpy(values).reshape(self.shape)


@dataclass
class PackedPart:
    """Output rows [start, stop) of a weight, one GGUF type, packed for the kernel."""

    qtype: GGMLQuantizationType
    start: int
    stop: int
    cols: int
    packed: torch.Tensor


class GGUFLinearMethod(LinearMethod):
    """x w^T from the layer's packed parts (layer.gguf_parts): one kernel call, or one per
    part each writing its columns of the output."""

    owns_packing = True

    def __init__(self, fp32_out: bool = False) -> None:
        self.fp32_out = fp32_out
        self.kernel = f"pagedllm gguf_linear ({ops.gguf_linear_isa()})"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        shape = x.shape
        y = parts_linear(x.reshape(-1, shape[-1]), layer.gguf_parts,
                         self.fp32_out or x.dtype == torch.float32)  # (an fp32 model's sums)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])


def parts_linear(x: torch.Tensor, parts: list[PackedPart], fp32_out: bool = False
                 ) -> torch.Tensor:
    """x [M, K] w^T from a weight's packed parts: one kernel call, or one per part each
    writing its columns of the output."""
    x = x.to(torch.bfloat16)
    if len(parts) == 1:
        p = parts[0]
        return ops.gguf_linear(x, p.packed, int(p.qtype), p.stop, fp32_out=fp32_out)
    y = torch.empty(x.shape[0], parts[-1].stop,
                    dtype=torch.float32 if fp32_out else torch.bfloat16)
    for p in parts:
        ops.gguf_linear(x, p.packed, int(p.qtype), p.stop - p.start, out=y[:, p.start:p.stop],
                        fp32_out=fp32_out)
    return y


class GGUFRows:
    """A linear's checkpoint tensors of GGUF types gathered into place by its weight_loader:
    for each type a byte matrix [out_features, bytes per row], and which rows it filled."""

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.rows: dict[GGMLQuantizationType, torch.Tensor] = {}
        self.filled: dict[GGMLQuantizationType, torch.Tensor] = {}

    def add(self, weight_loader, weight: GGUFWeight, shard: tuple) -> None:
        """Copy the weight's rows where the layer's weight_loader puts this shard's."""
        if weight.qtype not in self.rows:
            self.rows[weight.qtype] = torch.zeros(self.out_features, weight.data.shape[1],
                                                  dtype=torch.uint8)
            self.filled[weight.qtype] = torch.zeros(self.out_features, 1, dtype=torch.bool)
        weight_loader(self.rows[weight.qtype], weight.data, *shard)
        weight_loader(self.filled[weight.qtype],
                      torch.ones(weight.data.shape[0], 1, dtype=torch.bool), *shard)

    def runs(self) -> list[tuple[GGMLQuantizationType, int, int]] | None:
        """(type, first row, end row) of each run of rows of one type, in order; None where
        some rows came from no GGUF weight kept quantized."""
        owner = torch.full((self.out_features,), -1, dtype=torch.int64)
        types = list(self.rows)
        for i, t in enumerate(types):
            owner[self.filled[t][:, 0]] = i
        if (owner < 0).any():
            return None
        edges = [0, *((owner[1:] != owner[:-1]).nonzero()[:, 0] + 1).tolist(), self.out_features]
        return [(types[int(owner[a])], a, b) for a, b in zip(edges[:-1], edges[1:])]

    def dequantize_into(self, weight: torch.Tensor) -> None:
        """Write the gathered rows' values into the bf16 weight (rows of other formats were
        loaded into it already)."""
        for t, rows in self.rows.items():
            mask = self.filled[t][:, 0]
            weight.data[mask] = GGUFWeight(t, rows[mask], self.in_features).dequantize() \
                .to(weight.dtype)


def take_gguf(module: nn.Module, param: str, weight: GGUFWeight, shard: tuple) -> bool:
    """The loader's step for a GGUF weight to keep quantized, in place of the parameter's
    weight_loader copying a dequantized tensor into it: a linear's or an embedding's weight
    (they declare gguf_parts), or an expert's projection (layers/moe.py FusedMoE), on one
    rank. False where the module cannot hold it (the caller dequantizes it)."""
    if getattr(module, "tp_size", 1) != 1:
        return False
    if hasattr(type(module), "gguf_parts") and param == "weight":
        if getattr(module, "gguf_rows", None) is None:
            out_features, in_features = module.weight.shape
            module.gguf_rows = GGUFRows(out_features, in_features)
        module.gguf_rows.add(module.weight_loader, weight, shard)
        return True
    if hasattr(type(module), "gguf_experts"):
        return module.take_gguf(weight, *shard)
    return False


def pack_rows(gathered: GGUFRows) -> list[PackedPart] | None:
    """The gathered rows packed, one part per run of rows of one type; None where some rows
    cannot stay quantized."""
    runs = gathered.runs()
    if runs is None or not all(can_pack(t, gathered.in_features) for t, _, _ in runs):
        return None
    cols = gathered.in_features
    return [PackedPart(t, start, stop, cols,
                       pack_gguf(t, gathered.rows[t][start:stop], stop - start, cols))
            for t, start, stop in runs]


def finish_gguf(layer: nn.Module, fp32_out: bool = False) -> bool:
    """After loading: pack the layer's gathered GGUF rows and take the GGUF method (True),
    or, where some rows cannot stay quantized, dequantize them into the layer's weight for
    the bf16 methods (False)."""
    gathered: GGUFRows = layer.gguf_rows
    layer.gguf_rows = None
    parts = pack_rows(gathered)
    if parts is None:
        gathered.dequantize_into(layer.weight)
        return False
    layer.gguf_parts = parts
    layer.packed_weight = parts[0].packed if len(parts) == 1 else None
    layer.linear_method = GGUFLinearMethod(fp32_out)
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)  # never filled: no memory
    return True


def embedding_rows(layer: nn.Module, input_ids: torch.Tensor, dtype: torch.dtype
                   ) -> torch.Tensor:
    """The embeddings of the tokens from a GGUF embedding kept quantized (its one part)."""
    (part,) = layer.gguf_parts
    rows = dequantize_packed_rows(part.packed, part.qtype, part.stop, part.cols,
                                  input_ids.reshape(-1))
    return rows.to(dtype).reshape(*input_ids.shape, part.cols)


def model_parts(model: nn.Module) -> list[PackedPart]:
    """Every GGUF part the model's layers and experts hold (a tied embedding's once)."""
    seen, out = set(), []
    for m in model.modules():
        parts = list(getattr(m, "gguf_parts", None) or ())
        for w13, w2 in getattr(m, "gguf_experts", None) or ():
            parts += w13 + w2
        for p in parts:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def packed_bytes(model: nn.Module) -> int:
    """Bytes of every GGUF part the model holds."""
    return sum(p.packed.nbytes for p in model_parts(model))
