# W1-shaped offline run of pagedllm alone (64 requests, prompts 32-512, outputs 32-256):
#   python w1.py MODEL_DIR [both|prefill|full]
import time, sys, random
from pagedllm import LLM, SamplingParams
model = sys.argv[1]
llm = LLM(model=model, dtype="bfloat16")
random.seed(0)
prompts = [[random.randrange(1000, 30000) for _ in range(random.randint(32, 512))] for _ in range(64)]
lens = [random.randint(32, 256) for _ in range(64)]
llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]*4, use_tqdm=False)
mode = sys.argv[2] if len(sys.argv) > 2 else "both"
if mode in ("both", "prefill"):
    t = time.time()
    llm.generate([[p[0]+1]+p[1:] for p in prompts], [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]*64, use_tqdm=False)
    print(f"prefill only: {time.time()-t:.2f} s", flush=True)
if mode in ("both", "full"):
    t = time.time()
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens], use_tqdm=False)
    el = time.time() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"full: {el:.2f} s, {n/el:.1f} out tok/s", flush=True)
