"""Tensors on 2 MiB pages: the kernel really backs them with huge pages (read back from
/proc/self/smaps), their contents are what they were, and tied weights stay tied."""
from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch
from torch import nn

from pagedllm import memory
from pagedllm.utils import cdiv

pytestmark = pytest.mark.skipif(not memory.huge_pages_available(),
                                reason="transparent huge pages are off on this kernel")


def smaps_kib_at(address: int, field: str) -> int:
    """A field (KiB: "Rss", "AnonHugePages") of the mapping holding address, from
    /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def huge_kib_at(address: int) -> int:
    return smaps_kib_at(address, "AnonHugePages")


def rss_kib_at(address: int) -> int:
    return smaps_kib_at(address, "Rss")


def test_zeros_are_zero_aligned_and_on_huge_pages():
    t = memory.zeros((3, 1024, 1024), torch.bfloat16)   # 6 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    assert huge_kib_at(t.data_ptr()) >= 2048            # at fault time, where the kernel has them


def test_unpopulated_zeros_commit_pages_as_they_are_written():
    t = memory.zeros((64, 2**20), torch.uint8, populate=False)   # 64 MiB
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    assert rss_kib_at(t.data_ptr()) < 4096                 # nothing committed yet
    assert not t.any()                                     # untouched pages read as zeros
    t[10].fill_(7)
    t[40, 5] = 9
    assert 4096 <= rss_kib_at(t.data_ptr()) < 16384        # only the two pages written
    assert int(t.sum()) == 7 * 2**20 + 9


def test_the_kv_cache_is_zero_and_committed_only_as_it_is_written():
    """LLM() does not wait for the kernel to commit (zero, compact) the whole KV budget: the
    blocks' pages are committed as store_kv first writes them."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.kv_cache import KVCacheShape, allocate_kv_cache
    config = EngineConfig(kv_cache_memory_bytes=256 * 2**20, max_model_len=4096)
    shape = KVCacheShape(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16)
    kv = allocate_kv_cache(config, shape, torch.device("cpu"), 1, log=False)
    assert kv.nbytes > 200 * 2**20
    assert rss_kib_at(kv.data_ptr()) < 4096
    assert not kv[:, :, :64].any()
    kv[1, 3, 7] = 1.0                                      # one block of one layer's V
    assert rss_kib_at(kv.data_ptr()) < 8192
    assert int(kv.count_nonzero()) == kv[1, 3, 7].numel()


def test_moved_parameters_keep_values_identity_and_ties():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 4096, bias=False),
                          nn.Linear(256, 512))
    model[1].weight = model[0].weight                   # tied, like an LM head
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    moved = memory.move_to_huge_pages(params)
    assert moved >= sum(p.nbytes for p in params)
    assert list(model.parameters()) == params             # the same Parameter objects
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    assert model[1].weight is model[0].weight
    assert huge_kib_at(model[0].weight.data_ptr()) >= 2048


def assert_collapses(t: torch.Tensor, declined: tuple[int, ...]) -> None:
    """collapse_to_huge_pages over t's memory moves its whole 2 MiB pages onto huge pages
    and keeps its contents; skips where the kernel's errno is one of `declined`."""
    copy = t.clone()
    collapsed = memory.collapse_to_huge_pages([(t.data_ptr(), t.nbytes)])
    if collapsed == 0:
        # A range is collapsed whole or counted as 0: ask again for the kernel's reason. A
        # try that succeeds now (a CI machine's compaction freed pages between the two) is as
        # good as the first.
        first = cdiv(t.data_ptr(), memory.HUGE_PAGE) * memory.HUGE_PAGE
        last = (t.data_ptr() + t.nbytes) // memory.HUGE_PAGE * memory.HUGE_PAGE
        err = memory.collapse_errno(first, last - first)
        if err in declined:
            pytest.skip(f"the kernel declined to collapse this range now ({os.strerror(err)})")
        assert err == 0, os.strerror(err)
        collapsed = last - first
    assert collapsed >= 12 * 2**20                       # the whole 2 MiB pages inside it
    assert collapsed % memory.HUGE_PAGE == 0 and collapsed <= t.nbytes
    # The kernel said it collapsed them all; by the time smaps is read it may already have
    # split some again (a CI machine showed 10 of 14 MiB), so ask only that huge pages back
    # the range (without the madvise this kernel, THP in madvise mode, shows 0 here).
    assert huge_kib_at(t.data_ptr() + memory.HUGE_PAGE) >= 2048
    assert torch.equal(t, copy)


_MAPPINGS: list[mmap.mmap] = []


def test_collapse_moves_a_fresh_mapping_onto_huge_pages():
    """Anonymous memory just mapped and written: only the kernel's "no free 2 MiB pages
    now" (EAGAIN, ENOMEM; a CI machine hit it) excuses a refusal; any other (a bad range, a
    wrong flag) fails."""
    region = mmap.mmap(-1, 16 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _MAPPINGS.append(region)  # never unmapped under the tensor (a failure's report reads it)
    t = torch.frombuffer(region, dtype=torch.float32)
    t.copy_(torch.randn(t.numel()))
    assert_collapses(t, (errno.EAGAIN, errno.ENOMEM))


def test_collapse_moves_allocator_memory_onto_huge_pages():
    """Memory from the C allocator, as oneDNN's packings are: what an earlier test left in
    the heap may make the kernel decline a range (EINVAL: a page of it swapped out or
    already part of a huge page; a CI machine saw it once in a full run), which the engine
    takes as "not collapsed"; the fresh mapping's test above checks the call itself."""
    assert_collapses(torch.randn(4 * 2**20), (errno.EAGAIN, errno.ENOMEM, errno.EINVAL))


MOVE_MANY_SMALL = """
import torch
from pagedllm import memory

def anon_mib():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('RssAnon')) / 1024

# Free one 30 MiB block first: glibc then raises its mmap threshold (up to 32 MiB), so the
# 2 MiB tensors below come from its heap, as a mixture's experts do after a loader's large
# reads; memory freed there stays with the process until malloc_trim.
big = torch.ones(30 * 2**18)
del big
small = [torch.full((2**19,), float(i)) for i in range(320)]   # 320 x 2 MiB
before = anon_mib()
moved = memory.move_to_huge_pages(small)
print(moved / 2**20, anon_mib() - before, all(bool((t == i).all()) for i, t in enumerate(small)))
"""


def test_moving_many_small_tensors_frees_as_it_goes():
    """Moving 640 MiB of 2 MiB heap tensors onto huge pages grows resident memory by at most
    about one trim interval (256 MiB), not by the 640 MiB of the copies: the peak of loading
    an 18 GB Qwen3-30B-A3B file was twice its weights and did not fit a 24 GiB machine."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", MOVE_MANY_SMALL], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    moved, grown, same = run.stdout.split()
    assert float(moved) >= 640 and same == "True"
    assert float(grown) < 0.5 * 640, f"resident memory grew {grown} MiB moving 640 MiB"
