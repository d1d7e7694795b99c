"""Sliding windows and soft-capped scores in the C++ CPU attention kernels (cpu_paged)
against torch_native, the reference: whole steps (decode rows, short and long chunks over
a cached prefix, prompts with nothing cached) through cpu_paged.attention.

The blocks wholly before a row's window are "freed" in the kernel's block tables, as the
block manager frees them when every layer is sliding: their entries point at a block of
NaNs (any read of it shows in the output) or are -1 (FREED_BLOCK). The reference reads the
intact tables.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import cpu_paged, torch_native
from pagedllm.attention.context import Context
from pagedllm.kernels import build


@pytest.fixture(scope="module", autouse=True)
def kernel_builds():
    assert build.load() is not None, build.load_error


class Step:
    """One step's rows (num cached, num new) with random K/V in a paged cache."""

    def __init__(self, rows: list[tuple[int, int]], num_decodes: int, heads: int, kv_heads: int,
                 dim: int, block_size: int, dtype: torch.dtype, window: int | None,
                 freed: str | None, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-(c + n) // block_size) for c, n in rows]
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        nan_block = perm.pop()
        tables = [[perm.pop() for _ in range(m)] for m in need]
        width = max(need)
        self.ref_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
        self.kernel_tables = self.ref_tables.clone()
        for i, (c, _) in enumerate(rows):  # blocks wholly before the first new token's window
            dead = max(0, c - window + 1) // block_size if window and freed else 0
            self.kernel_tables[i, :dead] = nan_block if freed == "nan" else -1
        # Garbage in unused slots, NaNs in the block freed blocks point at.
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
        self.k_cache[nan_block] = float("nan")
        self.v_cache[nan_block] = float("nan")
        slots, qs, ks, vs = [], [], [], []
        for i, (c, n) in enumerate(rows):
            k = torch.randn(c + n, kv_heads, dim, generator=gen).to(dtype)
            v = torch.randn(c + n, kv_heads, dim, generator=gen).to(dtype)
            pos = torch.arange(c + n)
            all_slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
            torch_native.store_kvcache(k[:c], v[:c], self.k_cache, self.v_cache, all_slots[:c])
            slots.append(all_slots[c:])
            ks.append(k[c:])
            vs.append(v[c:])
            qs.append(torch.randn(n, heads, dim, generator=gen).to(dtype))
        self.q, self.k, self.v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        self.slots = torch.cat(slots)
        self.rows, self.num_decodes = rows, num_decodes

    def context(self, tables: torch.Tensor) -> Context:
        rows, d = self.rows, self.num_decodes
        if d == len(rows):  # a decode step
            return Context(is_prefill=False, slot_mapping=self.slots, block_tables=tables,
                           context_lens=torch.tensor([c + n for c, n in rows]))
        return Context(is_prefill=True, num_decodes=d, slot_mapping=self.slots,
                       block_tables=tables, context_lens=torch.tensor([c + n for c, n in rows[:d]]),
                       seqlens_q=[n for _, n in rows], seqlens_k=[c + n for c, n in rows])

    def run(self, window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.q.shape[-1] ** -0.5
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        out = cpu_paged.attention(self.q, self.k, self.v, kc, vc, self.context(self.kernel_tables),
                                  scale, window, softcap)
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        ref = torch_native.attention(self.q, self.k, self.v, kc, vc, self.context(self.ref_tables),
                                     scale, window, softcap)
        return out, ref


# Decodes (short and long contexts), then prefill rows: short chunks over a cached prefix
# (the paged kernel), a prompt with nothing cached (the prompt kernel), long chunks over a
# cached prefix (the prompt kernel over the gathered window), chunk edges inside windows.
MIXED = [(4, 1), (40, 1), (300, 1), (517, 1), (0, 21), (16, 13), (255, 9), (0, 300),
         (100, 40), (600, 64)]
DECODES = [(0, 1), (5, 1), (63, 1), (64, 1), (300, 1), (1000, 1)]


def check(rows, num_decodes, heads, kv_heads, dim, block_size, dtype, window, softcap, freed):
    step = Step(rows, num_decodes, heads, kv_heads, dim, block_size, dtype, window, freed,
                seed=dim + block_size + (window or 0))
    out, ref = step.run(window, softcap)
    assert not out.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# Windows smaller than every context, not multiples of the block, equal to one (64),
# larger than some contexts and larger than all (4096).
WINDOWS = [1, 7, 33, 64, 100, 4096]


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_mixed_step_bf16(dim, window, softcap):
    check(MIXED, 4, 8, 2, dim, 16, torch.bfloat16, window, softcap, "nan")


@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("window", [None, 7, 33, 100])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 4, 4), (40, 9, 3), (128, 8, 1)])
def test_mixed_step_fp32_and_generic_head_dim(dim, heads, kv_heads, window, softcap):
    # fp32 prompts take torch's path; head_dim 40 the kernel's generic (not vectorised) one
    check(MIXED, 4, heads, kv_heads, dim, 5, torch.float32, window, softcap, "nan")


@pytest.mark.parametrize("freed", ["nan", "minus1"])
@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("window", [1, 16, 17, 512, 4096])
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 256), (torch.bfloat16, 64),
                                       (torch.float32, 128)])
def test_decode_step(dtype, dim, window, softcap, freed):
    check(DECODES, len(DECODES), 8, 2, dim, 16, dtype, window, softcap, freed)


@pytest.mark.parametrize("window", [16, 45])
def test_single_stream_decode_per_kv_head_items(window):
    # one row: each kv head is a work item of its own
    check([(700, 1)], 1, 8, 4, 128, 16, torch.bfloat16, window, None, "nan")


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 16, 300, 600])
@pytest.mark.parametrize("dtype,dim,heads,kv_heads", [(torch.bfloat16, 64, 9, 3),
                                                      (torch.bfloat16, 256, 4, 1),
                                                      (torch.float32, 40, 9, 3)])
@pytest.mark.parametrize("row", [(1000, 1), (700, 5), (250, 13)])
def test_single_stream_cut_by_key_segments(row, dtype, dim, heads, kv_heads, window, softcap):
    # one row over several 256-key segments, cut between the threads at segment edges; the
    # blocks wholly before the window hold NaNs: no segment before it may be read
    check([row], int(row[1] == 1), heads, kv_heads, dim, 16, dtype, window, softcap, "nan")


@pytest.mark.parametrize("window", [1, 30, 500])
@pytest.mark.parametrize("dim", [64, 256])
def test_long_prompts_skip_tiles(dim, window):
    # prompts with nothing cached, several 32-key tiles wholly outside the windows
    check([(0, 700), (0, 33)], 0, 4, 2, dim, 16, torch.bfloat16, window, None, None)


def test_window_hides_nothing_takes_plain_kernels():
    # a window at least every context: dropped before the kernels, as without one
    step = Step(MIXED, 4, 8, 2, 64, 16, torch.bfloat16, None, None, seed=1)
    out_window, _ = step.run(4096, None)
    out_plain, _ = step.run(None, None)
    assert torch.equal(out_window, out_plain)
