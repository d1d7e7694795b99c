"""Recomputes the roofline shares of the runs in this folder with the bench's cost model as it is
now (docs/benchmarks.md, the MoE rows): python reroof_moe.py PRESET ... from the repository root."""
import json, sys, transformers
from pagedllm.bench.random_model import _MODEL_CLASSES, PRESETS
from pagedllm.loader.hf_loader import config_from_hf
from pagedllm.bench import workloads as wl
from pagedllm.bench.roofline import model_cost, workload_roofline, decode_step_roofline_seconds
for preset in sys.argv[1:]:
    cc, kw = PRESETS[preset]
    hf = getattr(transformers, cc)(**kw).to_dict(); hf["architectures"] = [_MODEL_CLASSES[cc]]
    cfg = config_from_hf(hf, preset); cost = model_cost(cfg)
    for kind in ("w1", "w2"):
        d = json.load(open(f"docs/benchmarks/families-2026-11-28/{preset}-{kind}.json"))
        w = d["workloads"][0]; p = w["params"]
        for r in d["results"]:
            old = r.get("roofline_fraction")
            roof = r["roofline"]
            if kind == "w1":
                work = wl.random_workload("throughput", p["num_prompts"], tuple(p["input_len"]), tuple(p["output_len"]), p["seed"], tuple(p["token_id_range"]))
                assert work.num_prompt_tokens == w["prompt_tokens"], "not the run's workload"
                new = workload_roofline(cost, work, 2, roof["peak_gflops"], roof["bandwidth_gbs"])
                frac = new.seconds / r["elapsed_s"]
                print(f"{preset} {kind} {r['engine']}: {r['output_tok_s']:.1f} tok/s, roofline {old:.0%} -> {frac:.0%} ({new.bound}; {new.compute_seconds:.1f} s compute, {new.memory_seconds:.1f} s memory)")
            else:
                if not r.get("decode_tok_s"): continue
                pl, ol = p["input_len"][0], p["output_len"][0]
                steps = range(pl + 1, pl + ol)
                s = sum(decode_step_roofline_seconds(cost, c, 2, roof["peak_gflops"], roof["bandwidth_gbs"]) for c in steps)
                print(f"{preset} {kind} {r['engine']}: decode {r['decode_tok_s']:.1f} tok/s, roofline {old:.0%} -> {r['decode_tok_s']/(len(steps)/s):.0%}")
