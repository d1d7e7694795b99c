"""Linear layers that know how tensor parallelism splits them (seed 002).

Column-parallel layers split the output features across ranks, row-parallel layers split
the input features and all-reduce the partial sums. With one rank they are plain linears.
Each weight carries a weight_loader that copies its rank's shard of a checkpoint tensor.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import all_reduce, get_tp_rank, get_tp_size
from pagedllm.layers.linear_methods import LinearMethod, TorchLinearMethod, select_linear_method


class LinearLayer:
    """Mixin of the modules whose 2-D `weight` is multiplied through a LinearMethod
    (layers/linear_methods.py): F.linear until process_weights_after_loading picks the
    method for the loaded weight, once; packed_weight is the method's packed form of it
    (where it is the only form, `weight` is an empty tensor: see linear_methods.py)."""

    linear_method: LinearMethod = TorchLinearMethod()
    packed_weight: torch.Tensor | None = None
    gguf_parts: list | None = None  # a GGUF weight kept quantized (layers/quantized.py)
    fp32_out = False  # the LM head: fp32 logits where the kernel has them

    def process_weights_after_loading(self) -> None:
        """Pick the method and let it prepare the weight, once (a packing frees the plain
        weight: a second pass would find nothing to pack)."""
        if self.packed_weight is not None:
            return
        self.linear_method = select_linear_method(self.weight, self.fp32_out)  # type: ignore[attr-defined]
        self.linear_method.process_weights_after_loading(self)  # type: ignore[arg-type]

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the weight, from whichever form the method holds (for an embedding
        tied to this layer)."""
        return self.linear_method.embedding(self, ids)  # type: ignore[arg-type]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(LinearLayer, nn.Module):
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
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (e.g. an MoE router: every rank routes every token)."""


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

    def silu_and_mul(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act (SiLU-and-mul) of this [gate; up] projection, in one pass where the method
        can."""
        return self.linear_method.apply_silu_and_mul(self, x, act)

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
        y = self.linear_method.apply(self, x)
        if self.tp_size > 1:
            all_reduce(y)
        return y + self.bias if self.bias is not None else y
