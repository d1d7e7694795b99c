import sys, time, collections
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads as wl
from pagedllm.bench.spec import speculative_config
from pagedllm.engine import model_runner as mr
torch.set_num_threads(2)
setting = sys.argv[1] if len(sys.argv) > 1 else "ngram"
k = int(sys.argv[2]) if len(sys.argv) > 2 else 8
llm = LLM(None, speculative_config=speculative_config(setting, k))
w = wl.spec_workload("code-edit", llm.get_tokenizer(), 256)
rec = []
orig = mr.ModelRunner.run
def run(self, batch, eos):
    t = time.perf_counter(); out = orig(self, batch, eos); rec.append((tuple(batch.num_new_tokens), time.perf_counter() - t)); return out
mr.ModelRunner.run = run
sp = SamplingParams(temperature=0, max_tokens=256)
for r in w.requests[:2]:
    llm.generate([r.prompt_token_ids], [sp], use_tqdm=False)
rec.clear()
t0 = time.perf_counter()
n = 0
for r in w.requests[:2]:
    o = llm.generate([r.prompt_token_ids], [sp], use_tqdm=False)[0]; n += len(o.outputs[0].token_ids)
T = time.perf_counter() - t0
steps = [x for x in rec if len(x[0]) == 1]
tot = sum(d for _, d in rec)
print(f"{setting}: {n} tokens in {T:.2f}s, steps {len(rec)} run() total {tot:.2f}s")
by = collections.defaultdict(list)
for nt, d in rec: by[nt[0] if len(nt)==1 else nt].append(d)
for key in sorted(by, key=str):
    v = sorted(by[key]); print(key, len(v), f"median {1000*v[len(v)//2]:.2f} ms")
