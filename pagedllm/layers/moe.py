"""Mixture-of-experts: top-k routing and the experts' SiLU-gated MLPs (Qwen2/3-MoE, Mixtral).

The experts' weights are stacked, each expert's contiguous: w13 [E, 2 * I, H] holds an
expert's gate rows then its up rows, w2 [E, H, I] its down projection. Tensor parallelism
splits every expert's intermediate dimension across ranks (gate/up rows, down columns),
as MergedColumnParallelLinear and RowParallelLinear split a dense MLP, and all-reduces the
partial sums.

On the CPU a step's tokens are grouped by expert: each expert that any token routes to
runs once, on all of its tokens' rows, so its weights are read once per step however many
tokens chose it (decode steps are bound by reading weights). Where dense linears take
pagedllm's packed bf16 kernel, bf16 experts are packed for it at load, in place
(pack_experts: w13 [E, 2I/16, H/2, 16, 2], w2 likewise). Grouping needs the counts on
the host; a CUDA decode step replayed from a graph (engine/cuda_graph.py) cannot wait for
them, so on CUDA every expert runs on every row and routing weights of 0 drop its output.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import all_reduce, get_tp_rank, get_tp_size
from pagedllm.kernels import ops, probes
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear_methods import takes_packed_bf16, unpack_bf16
from pagedllm.layers.quantized import GGUFRows, pack_rows, parts_linear

ExpertLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# which part of an expert a checkpoint tensor holds (gate_up: gate rows then up rows)
EXPERT_SHARDS = ("gate", "up", "gate_up", "down")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts and their fp32 weights: softmax over all experts in fp32,
    top-k (torch.topk on the same fp32 probabilities as HF transformers, so ties pick the
    same experts), then, with renormalize, the chosen k weights scaled to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _streaming_bf16_linear(max_rows: int) -> ExpertLinear:
    """x w^T through the weight-streaming kernel up to max_rows rows, else F.linear."""
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= max_rows:
            return ops.small_linear_bf16(x if x.stride(1) == 1 else x.contiguous(), w)
        return F.linear(x, w)
    return linear


def select_expert_linear(weight: torch.Tensor) -> ExpertLinear:
    """How an expert's projections are computed, for the loaded stacked weight: bf16 on a
    CPU that runs the weight-streaming kernel takes it for few rows; everything else
    (fp32, which must stay HF transformers' F.linear, and CUDA) takes F.linear."""
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and probes.has_avx512_bf16()):
        return _streaming_bf16_linear(probes.small_linear_rows())
    return F.linear


def pack_experts(w: torch.Tensor) -> torch.Tensor:
    """Stacked expert weights [E, N, K] packed for pagedllm's kernel, expert by expert in
    place (one expert's copy at a time): [E, N/16, K/2, 16, 2]."""
    e, n, k = w.shape
    for expert in w:
        expert.copy_(ops.pack_linear_weight_bf16(expert).view(n, k))
    return w.view(e, n // 16, k // 2, 16, 2)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:  # copy_ would broadcast one expert over all of them
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit the "
                         f"experts' {what} of shape {tuple(dst.shape)}")
    dst.copy_(src)


class FusedMoE(nn.Module):
    """The routed experts of one MoE block. forward takes the block's input rows and the
    router's logits for them (the router is a replicated linear the model holds).

    A GGUF's experts kept quantized (quantization="gguf") are gathered per expert as they
    load (take_gguf) and packed after (finish_gguf): gguf_experts then holds each expert's
    (gate/up parts, down parts) for layers/quantized.py parts_linear, in place of w13/w2."""

    gguf_experts: list | None = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool,
                 weights_in_fp32: bool = False) -> None:
        """weights_in_fp32: scale the experts' outputs by the fp32 routing weights (Mixtral
        in HF transformers) instead of the weights rounded to the activations' dtype
        (Qwen2/3-MoE)."""
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} does not "
                             f"split over {self.tp_size} tensor-parallel ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.weights_in_fp32 = renormalize, weights_in_fp32
        self.intermediate_size = intermediate_size // self.tp_size  # per rank
        i = self.intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()
        self.linear: ExpertLinear = F.linear
        self.gguf_gathered: dict[int, dict[str, object]] = {}  # expert -> shard -> GGUFWeight
        # forward_grouped's C++ path: whether to take it (tests compare it with the loop
        # here) and its description of the experts, keyed by what it describes
        self.use_kernel = True
        self._described: tuple | None = None
        # w13 and w2 hold the experts packed for pagedllm's kernel (pack_experts), in place
        # of their plain [E, N, K] form: every weight once, read as the dense linears are
        self.packed = False

    def process_weights_after_loading(self) -> None:
        if not self.packed and all(takes_packed_bf16(w) for w in (self.w13, self.w2)):
            self.w13.data = pack_experts(self.w13.data)
            self.w2.data = pack_experts(self.w2.data)
            self.packed = True
        self.linear = select_expert_linear(self.w13)
        # an instance attribute: calls go straight to the chosen method
        self.forward = self.forward_grouped if self.w13.is_cpu else self.forward_dense

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert: int | None,
                      shard: str) -> None:
        """Copy this rank's part of a checkpoint tensor: one expert's [rows, cols] (expert
        is its id) or every expert's, stacked [E, rows, cols] (expert None). shard names
        the part: "gate", "up", "gate_up" (both, gate rows first) or "down"."""
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        if (shard == "down") != (param is self.w2):
            raise ValueError(f"an expert's {shard} projection does not belong in this parameter")
        dst = param.data if expert is None else param.data[expert]
        i, rank = self.intermediate_size, self.tp_rank
        full = i * self.tp_size * (2 if shard == "gate_up" else 1)
        if loaded.shape[-1 if shard == "down" else -2] != full:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"the experts' {shard} projection (intermediate size "
                             f"{i * self.tp_size})")
        if shard == "down":
            _copy(dst, loaded.narrow(-1, rank * i, i), "down projection")
        elif shard == "gate_up":
            gate, up = loaded.chunk(2, dim=-2)
            _copy(dst.narrow(-2, 0, i), gate.narrow(-2, rank * i, i), "gate projection")
            _copy(dst.narrow(-2, i, i), up.narrow(-2, rank * i, i), "up projection")
        else:
            offset = 0 if shard == "gate" else i
            _copy(dst.narrow(-2, offset, i), loaded.narrow(-2, rank * i, i), f"{shard} projection")

    def take_gguf(self, weight, expert: int | None, shard: str) -> bool:
        """Keep one expert's GGUF projection (a GGUFWeight) for finish_gguf; False for a
        stacked tensor of every expert (the loader splits GGUF's per expert)."""
        if expert is None or shard not in ("gate", "up", "down"):
            return False
        self.gguf_gathered.setdefault(expert, {})[shard] = weight
        return True

    def finish_gguf(self) -> bool:
        """After loading: pack every expert's gathered projections (gate and up as one
        weight where their types agree), freeing w13 and w2 (True); where some expert's
        cannot stay quantized, dequantize them all into w13 and w2 instead (False)."""
        gathered, self.gguf_gathered = self.gguf_gathered, {}
        i, h = self.intermediate_size, self.w13.shape[2]
        packed = []
        for expert in range(self.num_experts):
            shards = gathered.get(expert, {})
            w13, w2 = GGUFRows(2 * i, h), GGUFRows(h, i)
            for shard, rows in shards.items():
                target = w2 if shard == "down" else w13
                target.add(self.weight_loader_rows, rows, (shard,))
            parts = (pack_rows(w13), pack_rows(w2)) if len(shards) == 3 else (None, None)
            if None in parts:
                break
            packed.append(parts)
        if len(packed) < self.num_experts:
            for expert, shards in gathered.items():
                for shard, rows in shards.items():
                    param = self.w2 if shard == "down" else self.w13
                    self.weight_loader(param, rows.dequantize().to(param.dtype), expert, shard)
            return False
        self.gguf_experts = packed
        self.w13.data = torch.empty(0, dtype=self.w13.dtype)
        self.w2.data = torch.empty(0, dtype=self.w2.dtype)
        return True

    @staticmethod
    def weight_loader_rows(buffer: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        """One expert's gate, up or down rows into place in its [gate; up] or down buffer
        (one rank)."""
        if shard == "up":
            buffer.narrow(0, buffer.shape[0] // 2, loaded.shape[0]).copy_(loaded)
        else:
            buffer.narrow(0, 0, loaded.shape[0]).copy_(loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of x (before loading: grouped)."""
        return self.forward_grouped(x, router_logits)

    def _routing(self, x: torch.Tensor, router_logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return (weights if self.weights_in_fp32 else weights.to(x.dtype)), ids

    def forward_grouped(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Each routed-to expert once, over the rows routed to it: in one C++ call for the
        rows it takes where the kernels run (the same results), else expert by expert here."""
        weights, ids = self._routing(x, router_logits)
        experts = self._cpu_experts(x)
        if experts is not None:
            out = ops.moe_experts(x.contiguous(), ids, weights.float(), *experts)
            if self.tp_size > 1:
                all_reduce(out)
            return out
        # the (token, expert) pairs sorted by expert: each expert's tokens are a run
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order].unsqueeze(1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            y = self._expert(expert, x.index_select(0, rows))
            out.index_add_(0, rows, (y * pair_weights[start:start + count]).to(x.dtype))
            start += count
        if self.tp_size > 1:
            all_reduce(out)
        return out

    def _cpu_experts(self, x: torch.Tensor) -> tuple[list, list, int] | None:
        """moe_experts' arguments after the rows (kernel_experts), None for rows it does not
        take: not on the CPU, or neither bf16 nor fp32 rows over GGUF experts."""
        if not (x.is_cpu and (x.dtype == torch.bfloat16
                              or (x.dtype == torch.float32 and self.gguf_experts is not None))):
            return None
        return self.kernel_experts()

    def kernel_experts(self) -> tuple[list, list, int] | None:
        """moe_experts' arguments after the rows: each expert's gate/up and down projections
        as the C++ kernels take them and up to how many rows bf16 ones stream their weight
        (described once, again if the weights moved: the same tuple while they stay); None
        where moe_experts does not apply: no kernels, use_kernel off, or fp32 weights (which
        keep torch's F.linear)."""
        if not (self.use_kernel and probes.available()):
            return None
        if self.gguf_experts is not None:
            key: tuple = ("gguf", id(self.gguf_experts))
        elif self.w13.dtype == torch.bfloat16 and self.w13.numel():
            key = ("bf16", self.w13.data_ptr(), self.w2.data_ptr())
        else:
            return None
        if self._described is None or self._described[0] != key:
            if self.gguf_experts is not None:
                def describe(parts) -> object:
                    return ops.stack_linear(parts[0].packed, parts[0].packed,
                                            [p.packed for p in parts], [int(p.qtype) for p in parts],
                                            [p.stop - p.start for p in parts], None)
                gate_up = [describe(w13) for w13, _ in self.gguf_experts]
                down = [describe(w2) for _, w2 in self.gguf_experts]
            else:
                gate_up = [ops.stack_linear(w, w, [], [], [], None) for w in self.w13]
                down = [ops.stack_linear(w, w, [], [], [], None) for w in self.w2]
            small_rows = probes.small_linear_rows() if probes.has_avx512_bf16() else 0
            self._described = (key, (gate_up, down, small_rows))
        return self._described[1]

    def forward_dense(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Every expert over every row, weighted by the rows' routing weights (0 where a row
        did not choose it): no host synchronisation, for CUDA graphs."""
        weights, ids = self._routing(x, router_logits)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype,
                            device=x.device).scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            out += (self._expert(expert, x) * dense[:, expert:expert + 1]).to(x.dtype)
        if self.tp_size > 1:
            all_reduce(out)
        return out

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's MLP, down(silu(gate(x)) * up(x)), over the rows routed to it."""
        if self.gguf_experts is not None:
            w13, w2 = self.gguf_experts[expert]
            return parts_linear(self.act_fn.forward(parts_linear(x, w13)), w2)
        if self.packed:
            w13, w2 = self.w13[expert], self.w2[expert]
            if x.dtype == torch.bfloat16 and x.dim() == 2:
                return ops.packed_linear_bf16(ops.packed_gate_up_silu_bf16(x, w13), w2)
            w13, w2 = unpack_bf16(w13), unpack_bf16(w2)
            return F.linear(self.act_fn.forward(F.linear(x, w13)), w2)
        h = self.act_fn.forward(self.linear(x, self.w13[expert]))
        return self.linear(h, self.w2[expert])
