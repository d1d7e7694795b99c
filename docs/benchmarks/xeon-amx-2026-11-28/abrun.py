import sys
mode = sys.argv[1]
if mode == "old":
    import torch
    from pagedllm.kernels import probes
    from pagedllm.layers import linear_methods, moe
    orig = linear_methods.takes_packed_bf16
    def old_rule(w):  # 20d8f0a: not on AMX CPUs
        return orig(w) and not probes.amx_linear_rows()
    linear_methods.takes_packed_bf16 = old_rule
    moe.takes_packed_bf16 = old_rule
    linear_methods.linear_weight_forms = lambda d, t: 2
from pagedllm.entrypoints.cli import main
sys.exit(main(sys.argv[2:]))
