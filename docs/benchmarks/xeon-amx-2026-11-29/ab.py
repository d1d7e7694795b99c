"""A/B of the GGUF kernel's paths in one process: W1 (32 requests), W2 decode, TTFT."""
import sys, time, json
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import ops
from pagedllm.bench.workloads import throughput_w1, latency_w2
model = sys.argv[1]; isas = sys.argv[2].split(","); rounds = int(sys.argv[3])
llm = LLM(model, num_threads=2)
w1 = throughput_w1(32)
def prompts(w): return [r.prompt_token_ids for r in w.requests]
def run_w1():
    llm.reset_prefix_cache()
    sps = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in w1.requests]
    t = time.perf_counter(); llm.generate(prompts(w1), sps, use_tqdm=False); dt = time.perf_counter() - t
    return w1.num_output_tokens / dt
w2 = latency_w2(128, 128)
def run_w2():
    llm.reset_prefix_cache()
    t = time.perf_counter(); llm.generate(prompts(w2), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False); ttft = time.perf_counter() - t
    llm.reset_prefix_cache()
    t = time.perf_counter(); llm.generate(prompts(w2), SamplingParams(temperature=0, max_tokens=129, ignore_eos=True), use_tqdm=False); dt = time.perf_counter() - t
    return ttft * 1e3, 128 / (dt - ttft)
res = {i: [] for i in isas}
run_w1()
for r in range(rounds):
    for isa in isas:
        ops.force_gguf_linear_isa(isa)
        a = run_w1(); b = run_w2()
        res[isa].append((a, *b))
        print(f"round {r} {isa:12s} W1 {a:7.1f} out tok/s  TTFT {b[0]:6.1f} ms  W2 decode {b[1]:6.1f} tok/s", flush=True)
ops.force_gguf_linear_isa("")
json.dump(res, open(sys.argv[4], "w"))
