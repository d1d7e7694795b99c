# moe_experts over one layer of random bf16 experts, plain (weight-streaming kernel) against
# packed (pagedllm packed kernel) descriptions, alternating, median of 7:
#   python moe_ab.py E H I TOP_K ROWS[,ROWS...]
import time, torch, sys
torch.set_num_threads(2)
from pagedllm.kernels import ops, probes
E, H, I, K = [int(v) for v in sys.argv[1:5]]
torch.manual_seed(0)
w13 = [torch.randn(2 * I, H, dtype=torch.bfloat16) * 0.02 for _ in range(E)]
w2 = [torch.randn(H, I, dtype=torch.bfloat16) * 0.02 for _ in range(E)]
plain = ([ops.stack_linear(w, w, [], [], [], None) for w in w13], [ops.stack_linear(w, w, [], [], [], None) for w in w2])
p13 = [ops.pack_linear_weight_bf16(w) for w in w13]; p2 = [ops.pack_linear_weight_bf16(w) for w in w2]
packed = ([ops.stack_linear(w, w, [], [], [], None) for w in p13], [ops.stack_linear(w, w, [], [], [], None) for w in p2])
small = probes.small_linear_rows()
for R in [int(v) for v in sys.argv[5].split(",")]:
    x = torch.randn(R, H, dtype=torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(R, E), -1), K)
    reached = ids.unique().numel()
    best = {"plain": [], "packed": []}
    for _ in range(7):
        for name, d in (("plain", plain), ("packed", packed)):
            t = time.perf_counter(); ops.moe_experts(x, ids, w.float(), *d, small); best[name].append(time.perf_counter() - t)
    med = {k: sorted(v)[3] for k, v in best.items()}
    print(f"R={R:3d} experts={reached:3d} plain {med['plain']*1e3:7.2f} ms packed {med['packed']*1e3:7.2f} ms  packed/plain {med['packed']/med['plain']:.2f}", flush=True)
