import importlib.util, sys, time, torch
spec = importlib.util.spec_from_file_location(sys.argv[1].rsplit("/",1)[1][:-3], sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
torch.manual_seed(0)
res = []
for (B, ctx, H, KV, D) in [(64, 380, 9, 3, 64), (1, 2048, 16, 8, 128), (16, 1024, 4, 1, 256)]:
    bs = 16; nb = B * (-(-ctx // bs)) + 1
    kc = torch.randn(nb, bs, KV, D, dtype=torch.bfloat16); vc = torch.randn_like(kc)
    tables = torch.randperm(nb - 1)[:B * (-(-ctx // bs))].view(B, -1).contiguous()
    q = torch.randn(B, H, D, dtype=torch.bfloat16)
    ones = torch.ones(B, dtype=torch.long); starts = torch.arange(B); kl = torch.full((B,), ctx)
    ts = []
    for it in range(40):
        out = torch.empty_like(q)
        t = time.perf_counter()
        m.paged_attention(out, q, kc, vc, tables, starts, ones, kl, D ** -0.5, None, None)
        ts.append(time.perf_counter() - t)
    # prompt kernel, no window
    T = 512; qp = torch.randn(T, H, D, dtype=torch.bfloat16); kp = torch.randn(T, KV, D, dtype=torch.bfloat16); vp = torch.randn_like(kp)
    op = torch.empty_like(qp); tp = []
    for it in range(10):
        t = time.perf_counter(); m.prompt_attention(op, qp, kp, vp, torch.tensor([0]), torch.tensor([T]), D ** -0.5); tp.append(time.perf_counter() - t)
    torch.save((out, op), f"/tmp/window-bench/micro-{sys.argv[2]}-{D}.pt")
    print(sys.argv[2], B, ctx, H, KV, D, "decode %.0f us" % (sorted(ts)[20] * 1e6), "prompt512 %.0f us" % (sorted(tp)[5] * 1e6))
