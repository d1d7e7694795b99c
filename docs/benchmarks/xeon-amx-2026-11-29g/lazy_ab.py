import sys, time, json
import torch
mode = sys.argv[1]
from pagedllm import memory
orig = memory.huge_page_bytes
memory.huge_page_bytes = lambda n, populate=True: orig(n, populate=(mode == "populate"))
from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import throughput_w1
torch.set_num_threads(2)
model = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
t0 = time.perf_counter(); llm = LLM(model); t_load = time.perf_counter() - t0
w = throughput_w1(num_prompts=int(sys.argv[3]) if len(sys.argv) > 3 else 64)
params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in w.requests]
llm.generate([list(range(1000, 1024))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate([r.prompt_token_ids for r in w.requests], params, use_tqdm=False)
T = time.perf_counter() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
rss = int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
print(json.dumps({"mode": mode, "load_s": round(t_load, 2), "w1_s": round(T, 2), "tok_s": round(n / T, 1), "rss_mib": round(rss)}))
