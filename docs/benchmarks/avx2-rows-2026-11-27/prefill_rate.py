"""Prefill rate of a batch of random prompts: python prefill_rate.py MODEL [N [LEN [prof]]]
(N prompts of LEN random token ids, one new token each, after a warm-up; three rounds;
"prof" adds a cProfile of a fourth). Used for the 2026-11-27 AVX2 GGUF tile change."""
import time, sys, torch
from pagedllm import LLM, SamplingParams
path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
L = int(sys.argv[3]) if len(sys.argv) > 3 else 256
llm = LLM(path, enable_prefix_caching=False)
g = torch.Generator().manual_seed(0)
def prompts(seed):
    g.manual_seed(seed)
    return [torch.randint(1000, 30000, (L,), generator=g).tolist() for _ in range(n)]
sp = SamplingParams(max_tokens=1, temperature=0)
llm.generate(prompts(1), sp, use_tqdm=False)
for r in range(3):
    t = time.perf_counter(); llm.generate(prompts(2 + r), sp, use_tqdm=False); dt = time.perf_counter() - t
    print(f"prefill {n}x{L}: {dt:.2f}s {n*L/dt:.1f} tok/s", flush=True)
if len(sys.argv) > 4:
    import cProfile, pstats
    cProfile.run("llm.generate(prompts(9), sp, use_tqdm=False)", "/tmp/s39/prefill.prof")
    pstats.Stats("/tmp/s39/prefill.prof").sort_stats("tottime").print_stats(25)
