# Single stream: 128 prompt tokens, 64 decoded, best of 3 (decode time = 65-token run minus 1-token run)
import time, sys, random
from pagedllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", enable_prefix_caching=False)
random.seed(1)
p = [random.randrange(1000, 30000) for _ in range(128)]
sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
sp = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
llm.generate([p], [sp1], use_tqdm=False)
best = 0
for _ in range(3):
    t = time.perf_counter(); llm.generate([p], [sp1], use_tqdm=False); t1 = time.perf_counter() - t
    t = time.perf_counter(); llm.generate([p], [sp], use_tqdm=False); t2 = time.perf_counter() - t
    best = max(best, 64 / (t2 - t1))
print(f"decode {best:.1f} tok/s")
