"""What a decode step costs by the number of drafts it verifies, on the bench's code-edit
workload (single stream, n-gram speculation, the bundled model): the step-cost ratios that
scripts/spec_decode_bound.py --costs takes.

Times ModelRunner.run for every step whose rows are all decode rows (a prompt step is left
out), by the step's draft count, and inside it the layer stack (the C++ decode stack), the
LM head and the verification; medians over three passes of the workload's first two prompts.

Usage: python spec_step_costs.py [num_speculative_tokens]
"""
import collections
import statistics
import sys
import time

import pagedllm.engine.model_runner as model_runner
from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads as wl


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    llm = LLM(enable_prefix_caching=False, num_threads=2, speculative_config=spec)
    runner = llm.engine.model_runner
    drafts: list[int | None] = [None]   # the running step's draft count (None: not timed)
    parts: dict[int, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))

    def timed(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if drafts[0] is not None:
                parts[drafts[0]][label].append(time.perf_counter() - t)
            return out
        setattr(obj, name, wrapper)

    timed(runner.decode_stack, "run", "layers")
    timed(runner.model, "compute_logits", "lm head")
    timed(runner, "verify_drafts", "verify")
    run = runner.run

    def run_step(batch, *args, **kwargs):
        decode = all(n == 1 + d for n, d in zip(batch.num_new_tokens, batch.num_spec_tokens))
        drafts[0] = sum(batch.num_spec_tokens) if decode else None
        t = time.perf_counter()
        out = run(batch, *args, **kwargs)
        if decode:
            parts[drafts[0]]["step"].append(time.perf_counter() - t)
        drafts[0] = None
        return out
    runner.run = run_step
    w = wl.spec_workload("code-edit", llm.get_tokenizer(), 256)
    for _ in range(3):
        for r in w.requests[:2]:
            llm.generate([r.prompt_token_ids], SamplingParams(temperature=0, max_tokens=256),
                         use_tqdm=False)
    labels = ["step", "layers", "lm head", "verify"]
    plain = statistics.median(parts[0]["step"])
    print("drafts  steps  " + "".join(f"{label} ms".rjust(11) for label in labels) + "  x plain")
    for d in sorted(parts):
        p = parts[d]
        cells = "".join(f"{statistics.median(p[label]) * 1e3:11.2f}" if p[label] else " " * 11
                        for label in labels)
        print(f"{d:6d}  {len(p['step']):5d}  {cells}  {statistics.median(p['step']) / plain:7.2f}")


if __name__ == "__main__":
    main()
