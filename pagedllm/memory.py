"""CPU tensors on 2 MiB pages (Linux transparent huge pages).

A decode step streams every weight and the KV cache of every running sequence: hundreds of
MB read once each. On 4 KiB pages each 4 KiB costs a TLB miss and a page walk. Memory
mapped by pagedllm itself with MADV_HUGEPAGE is backed by 2 MiB pages where the kernel
allows it (transparent_hugepage "always" or "madvise", the common default): measured on the
2-core Xeon, a single-stream decode step 13.1 -> 11.9 ms with everything on 2 MiB pages.

Where the kernel or platform says no, these are plain tensors: same results, only slower.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
from pathlib import Path

import torch

from pagedllm.utils import cdiv

HUGE_PAGE = 2 * 2**20
TRIM_EVERY = 256 * 2**20  # bytes freed between malloc_trim calls while loading
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE, _MADV_COLLAPSE = 14, 23, 25  # Linux 5.14+, 6.1+
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether memory advised with MADV_HUGEPAGE can get 2 MiB pages here."""
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def huge_page_bytes(nbytes: int, populate: bool = True) -> torch.Tensor:
    """A uint8 CPU tensor of nbytes zero bytes starting on a 2 MiB boundary, in an anonymous
    mapping advised for huge pages (a plain zeroed tensor where that is unavailable). The
    tensor keeps the mapping alive. populate=False leaves the pages to be committed as they
    are first written."""
    if nbytes <= 0 or not huge_pages_available():
        return torch.zeros(max(nbytes, 0), dtype=torch.uint8)
    # Room to start on a 2 MiB boundary: mmap only guarantees 4 KiB alignment.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    if not populate:
        return whole[start:start + nbytes]
    # Commit every page now (counted at start, not while serving): the kernel faults them in
    # already zeroed (MADV_POPULATE_WRITE, Linux 5.14+: 0.26 s for 2 GiB where writing zeros
    # took 4.2 s), else we write the zeros.
    try:
        region.madvise(_MADV_POPULATE_WRITE)
        return whole[start:start + nbytes]
    except OSError:
        return whole[start:start + nbytes].zero_()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = True) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on 2 MiB pages where possible;
    populate=False: pages committed as they are first written (huge_page_bytes)."""
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    return huge_page_bytes(numel * itemsize, populate).view(dtype).view(shape)


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Copy the contiguous CPU tensors' data into one region on 2 MiB pages and point each
    tensor (by .data, so Parameters stay the same objects) at its copy; tensors sharing
    storage (tied weights) are moved once. Returns the bytes moved."""
    if not huge_pages_available():
        return 0
    unique, seen = [], set()
    for t in tensors:
        if (t.device.type == "cpu" and t.is_contiguous() and t.numel()
                and t.data_ptr() not in seen):
            seen.add(t.data_ptr())
            unique.append(t)
    align = 64
    offsets, total = [], 0
    for t in unique:
        offsets.append(total)
        total += cdiv(t.nbytes, align) * align
    if not unique:
        return 0
    # Pages are committed as the copies write them, and each tensor is pointed at its copy at
    # once (its old memory freed if nothing else holds it): the peak is the weights plus one
    # tensor, not twice the weights.
    region = huge_page_bytes(total, populate=False)
    sharing: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        sharing.setdefault(t.data_ptr(), []).append(t)
    since_trim = 0
    for t, offset in zip(unique, offsets):
        copy = region[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        for same in sharing[t.data_ptr()]:
            same.data = copy
        # A tensor of a few MB (a mixture's expert) sat in the C allocator's heap, which keeps
        # what is freed: give it back as we go, or the peak is twice the weights again (an
        # 18 GB Qwen3-30B-A3B file did not fit a 24 GiB machine).
        since_trim += t.nbytes
        if since_trim >= TRIM_EVERY:
            release_free_memory()
            since_trim = 0
    return total


def collapse_to_huge_pages(ranges: list[tuple[int, int]]) -> int:
    """For memory allocated elsewhere (oneDNN's packed weights, which no tensor of ours can
    hold): ask the kernel to move each whole 2 MiB page inside the (address, nbytes) ranges
    onto a huge page now (MADV_COLLAPSE). Ranges closer than 64 KiB count as one (allocator
    headers between them); only the whole 2 MiB pages inside such a span are advised, and
    their contents stay as they are. Returns the bytes collapsed (0 where the kernel
    cannot)."""
    if not ranges or not huge_pages_available():
        return 0
    spans: list[list[int]] = []
    for start, nbytes in sorted(ranges):
        if spans and start - spans[-1][1] <= 64 * 1024:
            spans[-1][1] = max(spans[-1][1], start + nbytes)
        else:
            spans.append([start, start + nbytes])
    collapsed = 0
    for start, end in spans:
        first = cdiv(start, HUGE_PAGE) * HUGE_PAGE
        last = end // HUGE_PAGE * HUGE_PAGE
        if last > first and collapse_errno(first, last - first) == 0:
            collapsed += last - first
    return collapsed


def collapse_errno(address: int, nbytes: int, tries: int = 3) -> int:
    """MADV_HUGEPAGE then MADV_COLLAPSE on a 2 MiB-aligned range: 0 on success, else the
    errno (EAGAIN and ENOMEM: the kernel found no free 2 MiB pages just then, which
    fragmented memory makes common; both are retried, EAGAIN as the kernel's documentation
    suggests and ENOMEM because the failed try's compaction often frees a page for the
    next (a CI machine showed it); EINVAL: a kernel before 6.1)."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return errno.ENOSYS
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(address, nbytes, _MADV_HUGEPAGE) != 0:
        return ctypes.get_errno()
    for _ in range(tries):
        if madvise(address, nbytes, _MADV_COLLAPSE) == 0:
            return 0
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ENOMEM):
            return err
    return err


def release_free_memory() -> None:
    """Give the C allocator's free memory back to the kernel (glibc's malloc_trim; nothing
    elsewhere). Loading frees as much as it keeps (each weight's plain form once packed,
    the packings once copied onto huge pages), mostly in chunks below glibc's dynamic mmap
    threshold that stay in its heaps: ~0.5x the weights' size of RSS that no tensor holds."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    if t.is_mkldnn:  # oneDNN's opaque packing: no storage to ask, as many bytes as elements
        return id(t), t.numel() * t.element_size()
    if t.device.type == "meta":
        return 0, 0
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of memory the model's tensors hold: its parameters, buffers and every linear's
    packed_weight, each storage counted once (tied weights, views of one region), counted
    whole (a view of part of a storage keeps all of it alive). The KV cache is not a
    parameter or buffer: not counted."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.packed_weight for m in model.modules()
                if isinstance(getattr(m, "packed_weight", None), torch.Tensor)]
    sizes = dict(_storage_key_and_bytes(t) for t in tensors)
    return sum(size for key, size in sizes.items() if key)
