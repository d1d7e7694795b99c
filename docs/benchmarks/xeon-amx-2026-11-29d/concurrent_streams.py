# N concurrent greedy streams through LLM.generate: output tok/s (docs/quantization.md,
# "VNNI tiles for 2-8 rows"). Usage: python concurrent_streams.py FILE.gguf 1,2,4,8
import sys, time, json, torch
from pagedllm import LLM, SamplingParams
path, streams_list = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
llm = LLM(path, enable_prefix_caching=False, max_model_len=1024)
out = {}
for streams in streams_list:
    g = torch.Generator().manual_seed(streams)
    prompts = [[int(t) for t in torch.randint(100, 20000, (32,), generator=g)] for _ in range(streams)]
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    ts = []
    for _ in range(2):
        t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); ts.append(time.perf_counter() - t)
    out[streams] = streams * 128 / min(ts)
print(json.dumps(out))
