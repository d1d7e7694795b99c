"""How much n-gram speculation can gain on the bench's chat workloads at a given cost of
verifying, whatever the proposal lengths: the bound behind docs/benchmarks.md's
"Speculative decoding" figures.

Greedy decoding of each family's first two prompts (bench/spec_prompts.py, as `pagedllm
bench spec --spec-streams 1` runs them) gives the answers; at each position of an answer,
the n-gram proposer's draft (up to --k tokens, prompt_lookup_max 4) is matched against
what the answer says next. A policy picks each step's proposal length k; the step emits
the accepted tokens plus one and costs 1 + beta * k plain decode steps (beta: what a
verified draft token adds to a step, measured on the machine; e.g. the share of a plain
step's time that decode_layers adds per token of a verify step). Printed per family:
decode speedup over plain decoding for the engine's adaptive rule
(spec_decode/control.py), fixed k, and the oracle that proposes exactly the tokens that
will be accepted (no policy can do better). --costs prices a step of k drafts at the k-th
of measured ratios instead (step time at k drafts over a plain step's, k = 0..;
docs/benchmarks/zen5-2026-11-27c/spec_step_costs.py measures them).

Usage: python scripts/spec_decode_bound.py [--beta 0.33] [--costs 1,1.33,...] [--k 8]
       [--families ...]
"""
from __future__ import annotations

import argparse
import math
from typing import Callable

from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads as wl
from pagedllm.bench.spec_prompts import FAMILIES
from pagedllm.engine.spec_decode.control import ACCEPTANCE_SMOOTHING
from pagedllm.engine.spec_decode.ngram import propose_ngram

Policy = Callable[[float, int], int]   # (acceptance average, tokens the draft would match) -> k


def matches(prompt: list[int], answer: list[int], k: int) -> list[tuple[int, int]]:
    """Per position of the answer: (draft length, how many of its first tokens match)."""
    out = []
    for p in range(len(answer)):
        draft = propose_ngram(prompt + answer[:p], k, 1, 4)
        m = 0
        while m < len(draft) and p + m < len(answer) and draft[m] == answer[p + m]:
            m += 1
        out.append((len(draft), m))
    return out


def decode_cost(table: list[tuple[int, int]], policy: Policy,
                step_cost: Callable[[int], float]) -> float:
    """Plain-step units the answer's decoding costs under the policy (step_cost(k): a step
    verifying k drafts)."""
    p, cost, average = 0, 0.0, 1.0
    while p < len(table):
        length, m = table[p]
        k = min(policy(average, m), length, len(table) - p - 1)
        accepted = min(m, k)
        cost += step_cost(k)
        if k:
            average += ACCEPTANCE_SMOOTHING * (accepted / k - average)
        p += accepted + 1
    return cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beta", type=float, nargs="+", default=[0.33, 0.15])
    ap.add_argument("--costs", type=lambda v: [float(c) for c in v.split(",")],
                    help="measured step cost at 0, 1, 2, ... drafts (plain step = 1)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    llm = LLM(enable_prefix_caching=False)
    tables: dict[str, list[list[tuple[int, int]]]] = {}
    for family in args.families.split(","):
        w = wl.spec_workload(family, llm.get_tokenizer(), args.output_len)
        for r in w.requests[:2]:
            o = llm.generate([r.prompt_token_ids],
                             SamplingParams(temperature=0, max_tokens=r.output_len),
                             use_tqdm=False)[0]
            answer = list(o.outputs[0].token_ids)
            tables.setdefault(family, []).append(matches(r.prompt_token_ids, answer, args.k))
    policies: dict[str, Policy] = {
        "adaptive": lambda a, m: max(1, math.ceil(args.k * a - 1e-9)),
        **{f"k={k}": (lambda a, m, k=k: k) for k in (1, 2, 4, 8)},
        "oracle": lambda a, m: m,
    }
    pricings: dict[str, Callable[[int], float]] = {
        f"beta {beta}": (lambda k, beta=beta: 1 + beta * k) for beta in args.beta}
    if args.costs:
        costs = args.costs
        if len(costs) <= args.k:
            raise SystemExit(f"--costs needs {args.k + 1} values (0..{args.k} drafts)")
        pricings = {"measured costs": lambda k: costs[k]}
    for name, step_cost in pricings.items():
        print(f"{name}: decode speedup over plain decoding")
        print("family".ljust(18) + "".join(p.rjust(10) for p in policies))
        for family, answers in tables.items():
            tokens = sum(len(t) for t in answers)
            cells = [tokens / sum(decode_cost(t, policy, step_cost) for t in answers)
                     for policy in policies.values()]
            print(family.ljust(18) + "".join(f"{c:9.2f}x" for c in cells))


if __name__ == "__main__":
    main()
