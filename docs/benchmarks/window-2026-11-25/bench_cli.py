"""pagedllm bench, with WINDOW_TORCH=1 restoring the old routing (windows shorter than the
context and soft-caps to torch_native) for a before/after in one build."""
import os, sys
import pagedllm.attention.cpu_paged as cp
import pagedllm.attention.torch_native as tn
if os.environ.get("WINDOW_TORCH") == "1":
    orig = cp.attention
    def attention(q, k, v, kc, vc, ctx, scale, window=None, softcap=None):
        if window is not None and 0 < cp._longest_context(ctx) <= window:
            window = None
        if not kc.numel() or window is not None or softcap is not None:
            return tn.attention(q, k, v, kc, vc, ctx, scale, window, softcap)
        return orig(q, k, v, kc, vc, ctx, scale)
    cp.attention = attention
    print("old routing: windows/softcaps to torch", file=sys.stderr)
from pagedllm.entrypoints.cli import main
sys.argv[0] = "pagedllm"
sys.exit(main())
