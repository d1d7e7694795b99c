"""What a rejected draft costs at each batch size: the measurement behind
speculative_config's disable_by_batch_size default (DEFAULT_DISABLE_BY_BATCH_SIZE).

B random-token requests (W1-like: nothing a proposer guesses is accepted) decode together
on the bundled SmolLM2, with speculation off and with a proposer that gives every row d
draft tokens the model never accepts (adaptivity and stand-down off, so every step verifies
B * (1 + d) tokens). The ratio of the two times is what verifying costs when nothing is
gained; speculation at B rows only pays when the accepted tokens per row-step exceed
ratio - 1. The engines alternate per round in one process; medians are reported.

Usage: python scripts/spec_decode_standdown.py [--batch 1,2,4,8,16,32] [--drafts 1,4]
       [--tokens 48] [--rounds 3] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.engine.spec_decode.control import SpeculationControl
from pagedllm.engine.spec_decode.proposer import Proposer

REJECTED_TOKEN = 3   # a special token of SmolLM2's vocabulary: greedy decoding never picks it


class AlwaysRejected(Proposer):
    """d drafts of a token the model never emits, for every row it is asked about."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, seqs, max_lens):
        return [[REJECTED_TOKEN] * min(self.num_speculative_tokens, k) for k in max_lens]


def engine(drafts: int, threads: int | None) -> LLM:
    options = dict(kv_cache_memory_bytes=1 << 30, num_threads=threads)
    if drafts == 0:
        return LLM(**options)
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": drafts},
              **options)
    # (a measurement harness: the engine's own proposer and control are swapped out)
    llm.engine.scheduler.proposer = AlwaysRejected(drafts)
    llm.engine.scheduler.spec_control = SpeculationControl(adaptive=False,
                                                           disable_by_batch_size=None)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,2,4,8,16,32")
    ap.add_argument("--drafts", default="1,4")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the engine's; 1 on a shared, loaded machine)")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    drafts = [0] + [int(d) for d in args.drafts.split(",")]
    engines = {d: engine(d, args.threads) for d in drafts}
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'rows':>5}" + "".join(f"{'d=' + str(d) + ' s':>10}" for d in drafts)
          + "".join(f"{'ratio d=' + str(d):>12}" for d in drafts[1:]))
    for b in batches:
        prompts = [rng.integers(1000, 40000, size=args.prompt).tolist() for _ in range(b)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        for llm in engines.values():
            llm.engine.scheduler.max_num_seqs = b
        times: dict[int, list[float]] = {d: [] for d in drafts}
        outs = {}
        for _ in range(args.rounds):
            for d, llm in engines.items():
                start = time.perf_counter()
                outs[d] = llm.generate(prompts, params, use_tqdm=False)
                times[d].append(time.perf_counter() - start)
        med = {d: statistics.median(t) for d, t in times.items()}
        same = all([o.outputs[0].token_ids for o in outs[d]]
                   == [o.outputs[0].token_ids for o in outs[0]] for d in drafts)
        accepted = {d: sum(o.metrics.num_accepted_tokens for o in outs[d]) for d in drafts}
        row = {"rows": b, "seconds": med, "runs": times, "same_tokens": same,
               "ratio": {d: med[d] / med[0] for d in drafts[1:]}, "accepted": accepted}
        rows.append(row)
        print(f"{b:>5}" + "".join(f"{med[d]:>10.2f}" for d in drafts)
              + "".join(f"{row['ratio'][d]:>12.2f}" for d in drafts[1:])
              + ("" if same else "  (tokens differ!)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt": args.prompt, "tokens": args.tokens, "rounds": args.rounds,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
