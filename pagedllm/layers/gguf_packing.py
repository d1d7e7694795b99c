# TEMPORARY SHIM (not to be committed): stands in for the kernel branch's module
import torch
from gguf import GGMLQuantizationType as T
SUPPORTED_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
def can_pack(qtype, k):
    return k % (256 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 32) == 0
def pack_gguf(qtype, raw, n, k):
    from pagedllm.loader.dequant import dequantize
    return dequantize(raw, qtype, (n, k))
def dequantize_packed_rows(packed, qtype, n, k, rows):
    return packed[rows]
