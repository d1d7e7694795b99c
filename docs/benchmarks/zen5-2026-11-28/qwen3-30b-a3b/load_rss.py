import sys, time, threading, resource
from pagedllm import memory
from pagedllm.loader import model_loader as ml
def rss():
    d = {}
    for l in open('/proc/self/status'):
        if l.startswith(('RssAnon', 'RssFile')): d[l.split(':')[0]] = int(l.split()[1]) // 1024
    return d.get('RssAnon', -1) * 1000000 + d.get('RssFile', -1)
def wrap(mod, name):
    f = getattr(mod, name)
    def g(*a, **k):
        print(f"[rss] before {name}: {rss()} MiB", flush=True)
        r = f(*a, **k)
        print(f"[rss] after {name}: {rss()} MiB", flush=True)
        return r
    setattr(mod, name, g)
for n in ["keep_gguf_weights", "process_weights_after_loading", "move_weights_to_huge_pages"]:
    wrap(ml, n)
wrap(memory, "release_free_memory")
peak = [0]
def watch():
    while True:
        peak[0] = max(peak[0], rss()); time.sleep(0.2)
threading.Thread(target=watch, daemon=True).start()
from pagedllm import LLM, SamplingParams
t = time.time()
llm = LLM(sys.argv[1], num_threads=2, **eval(sys.argv[2] if len(sys.argv) > 2 else "{}"))
print(f"load {time.time()-t:.1f} s, rss {rss()} peak {peak[0]}", flush=True)
t = time.time()
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0))
print(f"{time.time()-t:.2f} s for 32 tokens, rss {rss()} peak {peak[0]}")
