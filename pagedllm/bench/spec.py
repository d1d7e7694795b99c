"""`pagedllm bench spec`: what speculative decoding gains where answers repeat their input,
and what it costs where nothing is accepted.

The chat families (bench/spec_prompts.py: code editing, summarization and extraction,
multi-turn chat quoting earlier turns, an agent repeating a tool-call format) run single
stream (their first two prompts one after the other) and 8 concurrent, greedy, with
speculation off, n-gram and suffix in the same run (or self-speculation, "self:N", and
draft models, "draft:PATH", whose time in the draft is reported beside); then W1 (random token ids, many
streams) and W2 (one random-token stream), where drafts are rarely accepted. Every setting
produces the same greedy tokens (checked and reported), so tok/s compare directly. Rounds
alternate between the settings; the median is kept.

With --compare llamacpp, llama.cpp's server runs the same cases in the same rounds, right
after pagedllm's settings, with speculation off and with its own n-gram speculation
(bench/spec_llamacpp.py); its rows carry engine "llama.cpp" and their speedup is over its
own "off". Its greedy tokens are compared with pagedllm's "off" and reported, not required
to match (other kernels round differently).

Prefix caching is off in every engine (a prefix cache warmed by an earlier round would
favour whichever engine ran before), and each suffix measurement gets a fresh engine: its
global cache would otherwise hold the identical answers of the earlier rounds.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from pagedllm.bench import workloads as wl
from pagedllm.bench.results import SpecRow
from pagedllm.bench.spec_llamacpp import ENGINE, LlamaMeasurement, LlamaSpecPeer
from pagedllm.llm import LLM
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

SINGLE_STREAM_PROMPTS = 2


def speculative_config(setting: str, k: int) -> dict | None:
    """The engine's speculative_config for a bench setting (defaults otherwise: adaptive,
    stand-down at DEFAULT_DISABLE_BY_BATCH_SIZE decode rows)."""
    if setting == "off":
        return None
    if setting == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    if setting == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    kind, _, arg = setting.partition(":")
    if kind == "self" and arg.isdigit() and int(arg) > 0:
        return {"method": "self", "num_draft_layers": int(arg), "num_speculative_tokens": k}
    if kind == "draft" and arg:
        return {"model": arg, "num_speculative_tokens": k}
    raise ValueError(f"unknown speculation setting {setting!r}; known: "
                     f"{', '.join(wl.SPEC_SETTINGS)}, self:N (N > 0 layers), draft:PATH")


@dataclass
class SpecCase:
    """One measurement: the workload's requests all at once (streams > 1), or its first
    SINGLE_STREAM_PROMPTS one after another (streams == 1)."""

    workload: wl.Workload
    streams: int
    ignore_eos: bool

    @property
    def requests(self) -> list[wl.BenchRequest]:
        n = self.streams if self.streams > 1 else SINGLE_STREAM_PROMPTS
        return self.workload.requests[:n]


def build_cases(tokenizer: Any, families: list[str], streams: list[int], max_output_len: int,
                random_prompts: int, vocab_size: int) -> list[SpecCase]:
    """Each chat family at each stream count; then W1 with random_prompts requests and W2
    (none when random_prompts is 0)."""
    cases = []
    for family in families:
        w = wl.spec_workload(family, tokenizer, max_output_len)
        cases += [SpecCase(w, n, ignore_eos=False) for n in streams]
    if random_prompts:
        ids = wl.token_id_range(vocab_size)
        w1 = wl.throughput_w1(random_prompts, id_range=ids)
        cases.append(SpecCase(w1, len(w1.requests), ignore_eos=True))
        cases.append(SpecCase(wl.latency_w2(id_range=ids), 1, ignore_eos=True))
    return cases


def proposer_seconds(llm: LLM) -> float | None:
    """Seconds a draft model's proposer has spent in propose() so far (None: no draft model)."""
    stats = getattr(llm.engine.scheduler.proposer, "stats", None)
    return stats.seconds if stats is not None else None


def run_case(llm: LLM, case: SpecCase) -> tuple[float, list[RequestOutput]]:
    """Seconds and outputs of one pass."""
    prompts = [r.prompt_token_ids for r in case.requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=case.ignore_eos)
              for r in case.requests]
    start = time.perf_counter()
    if case.streams > 1:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    seconds = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"pagedllm failed {len(errors)} requests: {errors[0]}")
    return seconds, outputs


class SpecBench:
    """One engine per setting (a fresh one per suffix measurement), rounds alternating."""

    def __init__(self, model: str | None, engine_kwargs: dict, settings: list[str], k: int,
                 rounds: int, peer: LlamaSpecPeer | None = None) -> None:
        """peer: llama.cpp's server under its own settings, measured in the same rounds
        right after pagedllm's (its rows: engine "llama.cpp", speedup vs its own "off")."""
        self.model, self.engine_kwargs = model, engine_kwargs
        self.settings, self.k, self.rounds, self.peer = settings, k, rounds, peer
        self._engines: dict[str, LLM] = {}

    def engine(self, setting: str) -> LLM:
        if setting == "suffix" or setting not in self._engines:
            self._engines.pop(setting, None)
            gc.collect()
            llm = LLM(self.model, speculative_config=speculative_config(setting, self.k),
                      **self.engine_kwargs)
            llm.generate([list(range(1000, 1024))],   # first-shape costs, outside the timing
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
            self._engines[setting] = llm
        return self._engines[setting]

    def run(self, cases: list[SpecCase]) -> list[SpecRow]:
        rows = []
        peer_settings = list(self.peer.settings) if self.peer is not None else []
        runs = len(self.settings) + len(peer_settings)
        with tqdm(total=len(cases) * runs * self.rounds, desc="bench spec",
                  unit="run", dynamic_ncols=True) as bar:
            for case in cases:
                times: dict[str, list[float]] = {s: [] for s in self.settings}
                decode_times: dict[str, list[float]] = {s: [] for s in self.settings}
                draft_times: dict[str, list[float]] = {s: [] for s in self.settings}
                outputs: dict[str, list[RequestOutput]] = {}
                peer_runs: dict[str, list[LlamaMeasurement]] = {s: [] for s in peer_settings}
                for _ in range(self.rounds):
                    for setting in self.settings:
                        bar.set_description(
                            f"bench spec: {case.workload.name} x{case.streams} {setting}")
                        llm = self.engine(setting)
                        before = proposer_seconds(llm)
                        seconds, outputs[setting] = run_case(llm, case)
                        times[setting].append(seconds)
                        decode_times[setting].append(decode_seconds(outputs[setting]))
                        if before is not None:
                            draft_times[setting].append(proposer_seconds(llm) - before)
                        bar.update(1)
                    for setting in peer_settings:
                        bar.set_description(f"bench spec: {case.workload.name} x{case.streams} "
                                            f"{ENGINE} {setting}")
                        peer_runs[setting].append(run_peer_case(self.peer, setting, case))
                        bar.update(1)
                for s in self.settings:
                    row = spec_row(case, s, times[s], outputs[s], outputs.get("off"),
                                   times.get("off"), decode_times[s], decode_times.get("off"))
                    if draft_times[s]:
                        row.draft_seconds = statistics.median(draft_times[s])
                    rows.append(row)
                base = [o.outputs[0].token_ids for o in outputs["off"]] if "off" in outputs else None
                for s in peer_settings:
                    rows.append(peer_row(case, s, peer_runs[s], peer_runs["off"], base))
        return rows

    def close(self) -> None:
        self._engines.clear()
        gc.collect()
        if self.peer is not None:
            self.peer.close()


def decode_seconds(outputs: list[RequestOutput]) -> float:
    """Seconds in which some request of a pass was decoding: the union of each request's
    span from its first token (the prompt's, which the prefill gives) to its last."""
    spans = sorted((o.metrics.first_token_time, o.metrics.finished_time) for o in outputs
                   if o.metrics.first_token_time is not None
                   and o.metrics.finished_time is not None)
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def spec_row(case: SpecCase, setting: str, times: list[float], outputs: list[RequestOutput],
             base: list[RequestOutput] | None, base_times: list[float] | None,
             decode_times: list[float] | None = None,
             base_decode_times: list[float] | None = None) -> SpecRow:
    """decode_times: each round's decode_seconds (the decode columns: tokens after each
    request's first over them, which leaves the prompts' prefill, the same with and without
    speculation, out)."""
    seconds = statistics.median(times)
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = SpecRow(case.workload.name, case.streams, setting, seconds, times, n, n / seconds)
    if decode_times:
        row.decode_s = statistics.median(decode_times)
        row.decode_tok_s = (n - len(outputs)) / row.decode_s if row.decode_s > 0 else None
    if base is not None and base_times:
        row.speedup = statistics.median(base_times) / seconds
        if base_decode_times and row.decode_tok_s:
            base_n = sum(len(o.outputs[0].token_ids) - 1 for o in base)
            row.decode_speedup = row.decode_tok_s / (base_n / statistics.median(base_decode_times))
        row.same_tokens_as_off = all(a.outputs[0].token_ids == b.outputs[0].token_ids
                                     for a, b in zip(base, outputs, strict=True))
    for o in outputs:
        m = o.metrics
        row.num_drafts += m.num_drafts
        row.num_draft_tokens += m.num_draft_tokens
        row.num_accepted_tokens += m.num_accepted_tokens
        row.per_request.append({
            "output_tokens": len(o.outputs[0].token_ids), "num_drafts": m.num_drafts,
            "num_draft_tokens": m.num_draft_tokens, "num_accepted_tokens": m.num_accepted_tokens,
            "acceptance_rate": m.acceptance_rate,
            "mean_acceptance_length": m.mean_acceptance_length})
    set_acceptance(row)
    return row


def set_acceptance(row: SpecRow) -> None:
    """row's acceptance rate and mean acceptance length from its draft counts (None where it
    drafted nothing)."""
    if row.num_draft_tokens:
        row.acceptance_rate = row.num_accepted_tokens / row.num_draft_tokens
    if row.num_drafts:
        row.mean_acceptance_length = 1 + row.num_accepted_tokens / row.num_drafts


def run_peer_case(peer: LlamaSpecPeer, setting: str, case: SpecCase) -> LlamaMeasurement:
    """One pass of the case on llama-server, as run_case does on pagedllm."""
    reqs = case.requests
    return peer.measure(setting, [r.prompt_token_ids for r in reqs], [r.output_len for r in reqs],
                        case.ignore_eos, concurrent=case.streams > 1)


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """Where two runs' greedy tokens first part: the request, the index of its first
    differing token, both lengths (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            same = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return {"request": i, "token": same, "lengths": [len(x), len(y)]}
    return None


def peer_row(case: SpecCase, setting: str, runs: list[LlamaMeasurement],
             base_runs: list[LlamaMeasurement], pagedllm_off: list[list[int]] | None) -> SpecRow:
    """A llama.cpp row: median seconds, counts of the last pass, speedup in tok/s over
    llama.cpp's own "off", greedy tokens compared with its "off" and with pagedllm's "off"."""
    last = runs[-1]
    tokens = [c.token_ids for c in last.completions]
    times = [m.seconds for m in runs]
    seconds = statistics.median(times)
    n = sum(len(t) for t in tokens)
    row = SpecRow(case.workload.name, case.streams, setting, seconds, times, n, n / seconds,
                  engine=ENGINE)
    # tok/s, not seconds: llama.cpp's speculation may change its greedy tokens and so the
    # answers' lengths (EOS elsewhere)
    base_tokens = sum(len(c.token_ids) for c in base_runs[-1].completions)
    row.speedup = row.tok_s / (base_tokens / statistics.median(m.seconds for m in base_runs))
    row.same_tokens_as_off = tokens == [c.token_ids for c in base_runs[-1].completions]
    if pagedllm_off is not None:
        row.vs_pagedllm_off = {"same_tokens": tokens == pagedllm_off,
                               "first_difference": first_difference(pagedllm_off, tokens)}
    row.num_drafts, row.num_draft_tokens = last.num_drafts, last.num_draft_tokens
    row.num_accepted_tokens = last.num_accepted_tokens
    row.per_request = [c.summary() for c in last.completions]
    set_acceptance(row)
    return row
