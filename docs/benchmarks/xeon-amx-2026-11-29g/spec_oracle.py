import sys, math
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads as wl
from pagedllm.engine.spec_decode.ngram import propose_ngram
torch.set_num_threads(2)
fam = sys.argv[1] if len(sys.argv) > 1 else "code-edit"
llm = LLM(None)
w = wl.spec_workload(fam, llm.get_tokenizer(), 256)
sp = SamplingParams(temperature=0, max_tokens=256)
cases = []
for r in w.requests[:2]:
    o = llm.generate([r.prompt_token_ids], [sp], use_tqdm=False)[0]
    cases.append((list(r.prompt_token_ids), list(o.outputs[0].token_ids)))
def cost(n, base=5.9, per=1.2): return base + per * (n - 1)
def simulate(policy, k_max, min_n=1, max_n=4, adaptive=True, smoothing=0.5):
    total_t = total_tok = steps = 0
    for prompt, out in cases:
        pos, acc_avg = 0, 1.0
        while pos < len(out):
            ctx = prompt + out[:pos]
            k = max(1, math.ceil(k_max * acc_avg - 1e-9)) if adaptive else k_max
            k = min(k, len(out) - pos - 1)
            prop = policy(ctx, k, min_n, max_n) if k > 0 else []
            a = 0
            while a < len(prop) and prop[a] == out[pos + a]: a += 1
            if prop: acc_avg += smoothing * (a / len(prop) - acc_avg)
            total_t += cost(1 + len(prop)); steps += 1
            pos += a + 1
        total_tok += len(out)
    base = sum(len(o) for _, o in cases) * cost(1)
    return base / total_t, total_tok / steps
for k in (4, 8, 12, 16, 24):
    for mn, mx in ((1, 4), (2, 4), (1, 8), (3, 8)):
        for ad in (True, False):
            s, tps = simulate(propose_ngram, k, mn, mx, ad)
            print(f"k={k:2d} n={mn}-{mx} adaptive={ad!s:5}: speedup {s:.2f}  tokens/step {tps:.2f}")
tok = llm.get_tokenizer()
if len(sys.argv) > 2:
    p, o = cases[0]
    print("PROMPT:", tok.decode(p)[-3000:])
    print("OUTPUT:", tok.decode(o))
    # mark, per output token, whether ngram (n=1-4, k=8) would have proposed it correctly from the context
    marks = []
    for i, t in enumerate(o):
        prop = propose_ngram(p + o[:i], 1, 1, 4)
        marks.append("+" if prop == [t] else ("?" if not prop else "-"))
    print("".join(marks))
