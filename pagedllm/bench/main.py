"""`pagedllm bench`: run the workloads on pagedllm and its peers side by side, in one run.

    pagedllm bench throughput --dtype float32,bfloat16 --compare hf
    pagedllm bench all --compare hf,llamacpp --llama-server /path/to/llama-server
    pagedllm bench serve --base-url http://127.0.0.1:8000 --request-rate 4
    pagedllm bench spec --spec-settings off,ngram,suffix --spec-streams 1,8
    pagedllm bench spec --compare llamacpp --llama-spec ngram-simple:4,ngram-mod:24
    pagedllm bench throughput --shape nanovllm --device cuda --dtype bfloat16 \
        --compare hf --hf-num-prompts 64 --hf-batch-sizes 64
    pagedllm bench latency --device cuda --dtype bfloat16 --eager-too

One run measures the machine (matmul peak, memory bandwidth; on --device cuda the GPU's),
then every engine on the same token ids, and reports each engine's fraction of the
workload's roofline.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from tqdm.auto import tqdm

from pagedllm.bench import workloads as wl
from pagedllm.bench.hardware import MachineMeasurement, machine_info, measure_machine
from pagedllm.bench.llamacpp_runner import default_llama_bench, default_llama_server, gguf_for_dtype
from pagedllm.bench.report import (format_bounds, format_comparisons, format_machine,
                                   format_serving, format_spec_table, format_table,
                                   speedups_over_eager, write_chart, write_json)
from pagedllm.bench.results import (SCHEMA, BenchResult, LatencyRun, Runner, latency_result, pooled,
                                    throughput_result)
from pagedllm.bench.roofline import (ModelCost, decode_step_roofline_seconds, model_cost,
                                     prefill_roofline_seconds, workload_roofline)
from pagedllm.bench.serve import run_serve
from pagedllm.bench.spec_llamacpp import DEFAULT_LLAMA_SPEC, parse_llama_spec
from pagedllm.bench.spec_prompts import FAMILIES
from pagedllm.config import EngineConfig

WORKLOADS = ("throughput", "latency", "prefix", "serve", "spec", "all")
PEERS = ("hf", "llamacpp", "llamabench")
DTYPES = ("float32", "bfloat16")
# Set by the bench itself, so not taken from the engine flags.
_BENCH_OWNED = {"dtype", "num_threads", "seed", "enable_prefix_caching"}


# ---- arguments ---------------------------------------------------------------------------

def _int_range(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "32:512" -> (32, 512)."""
    try:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None


def _csv(choices: tuple[str, ...] | None = None):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if choices is not None and t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {choices}, got {text!r}")
        return items
    return parse


def _spec_settings(text: str) -> list[str]:
    from pagedllm.bench.spec import speculative_config
    items = _csv()(text)
    for item in items:
        try:
            speculative_config(item, 1)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return items


def _llama_spec(text: str) -> str:
    try:
        parse_llama_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The bench's own flags plus every engine flag (EngineConfig); the bench's win on clashes."""
    p.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: bundled SmolLM2-135M-Instruct)")
    # Timed runs measure an engine whose KV memory is committed, as llama-server's and HF's
    # are once started: the page faults of a fresh CPU cache cost W1 ~6% on a Qwen3-0.6B file
    # (--no-kv-cache-populate measures them)
    EngineConfig.add_cli_args(p.add_argument_group("engine (pagedllm)"),
                              defaults={"kv_cache_populate": True})
    p.add_argument("workload", choices=WORKLOADS,
                   help="throughput (W1), latency (W2), prefix (W3), serve (HTTP), spec "
                        "(speculative decoding: chat tasks that repeat their input, then W1 "
                        "and W2, speculation off / ngram / suffix), all (W1+W2+W3)")
    g = p.add_argument_group("workload")
    g.add_argument("--shape", choices=["w1", "nanovllm"], default="w1",
                   help="throughput shape: W1 (32-512 in, 32-256 out) or nano-vllm's (100-1024 both)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests (default: 64 for throughput, 256 with --shape nanovllm, 32 "
                        "for prefix, 64 for serve)")
    g.add_argument("--input-len", type=_int_range, default=None,
                   help="prompt length N or MIN:MAX (prefix: the per-request suffix length)")
    g.add_argument("--output-len", type=_int_range, default=None, help="output length N or MIN:MAX")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared prefix of the prefix workload")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload's random token ids and lengths")
    g.add_argument("--structured-output", choices=["none", "json"], default="none",
                   help="json: every pagedllm request under a JSON schema that no output of "
                        "the workload's length completes (the mask's cost per token)")
    g.add_argument("--latency-iters", type=int, default=3, help="timed runs of the latency request (median kept)")
    g.add_argument("--latency-rounds", type=int, default=1,
                   help="with --compare llamabench: the latency request in this many rounds, "
                        "pagedllm and llama-bench in turn (--latency-iters runs each a round; "
                        "all runs pooled, median kept; each round's ratio in the JSON): a "
                        "machine whose memory bandwidth drifts over minutes drifts for both")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up requests of each engine")
    r = p.add_argument_group("run")
    r.add_argument("--dtype", type=_csv(("auto", *DTYPES)), default=["auto"],
                   help="dtypes to run, comma-separated, e.g. float32,bfloat16 (default: the engine's)")
    r.add_argument("--threads", "--num-threads", dest="threads", type=int, default=os.cpu_count() or 1,
                   help="threads of every engine and of the machine measurements (default: all cores)")
    r.add_argument("--compare", type=_csv(PEERS), action="extend", default=[],
                   help="peers to run on the same token ids: hf, llamacpp (its server), llamabench (llama.cpp's llama-bench, latency only) (comma-separated)")
    r.add_argument("--hf-batch-sizes", type=_csv_ints, default=[8, 32, 64],
                   help="static batch sizes HF transformers tries; the fastest is reported")
    r.add_argument("--hf-num-prompts", type=int, default=None,
                   help="HF transformers runs only the first N requests of the throughput and "
                        "prefix workloads, each with its own lengths (its row says so; tokens/s "
                        "compare) (default: all of them)")
    r.add_argument("--pagedllm-on-hf-subset", action="store_true",
                   help="with --hf-num-prompts: pagedllm also runs HF's subset (one more row)")
    r.add_argument("--eager-too", action="store_true",
                   help="run pagedllm a second time with --enforce-eager (no CUDA graphs, no "
                        "CPU decode stack) and report both rows and the speedup over eager")
    r.add_argument("--llama-server", default=None,
                   help="path of a llama.cpp llama-server binary (default: $PAGEDLLM_LLAMA_SERVER, "
                        "else the one scripts/build_llamacpp.sh built, if any)")
    r.add_argument("--llama-gguf", default=None,
                   help="GGUF for llama.cpp (default: the model converted to F32/BF16 per dtype)")
    r.add_argument("--llama-parallel", type=int, default=16, help="llama.cpp server slots")
    r.add_argument("--llama-no-repack", action="store_true",
                   help="run llama.cpp with its weights as the GGUF stores them (--no-repack, "
                        "llama-bench --repack 0): its repacked layout is slower on some CPUs")
    r.add_argument("--keep-going", action="store_true",
                   help="an engine that fails is noted (in the JSON's failures and the exit "
                        "status) and the run goes on with the next one")
    r.add_argument("--quick-machine", action="store_true",
                   help="measure the machine with small sizes (seconds, rougher; on CUDA a "
                        "4096^3 matmul and a 256 MiB copy instead of 8192^3 and 1 GiB)")
    s = p.add_argument_group("serve")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server")
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default: inf, all at once)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    s.add_argument("--served-model-name", default=None, help="model name (default: GET /v1/models)")
    s.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send token ids (exact lengths) or their detokenized text")
    sp = p.add_argument_group("spec (speculative decoding)")
    sp.add_argument("--spec-settings", type=_spec_settings, default=list(wl.SPEC_SETTINGS),
                    help="speculation settings to compare, comma-separated: off, ngram, suffix, "
                         "self:N (the model's first N layers draft), draft:PATH (a draft model "
                         "with the same tokenizer) (default: off,ngram,suffix)")
    sp.add_argument("--spec-families", type=_csv((*FAMILIES, "none")), default=list(FAMILIES),
                    help="chat workload families, comma-separated (default: all; none: only "
                         "W1 and W2)")
    sp.add_argument("--spec-streams", type=_csv_ints, default=[1, 8],
                    help="concurrent streams of each family, comma-separated (1: the first two "
                         "prompts one after the other; at most 8)")
    sp.add_argument("--spec-k", type=int, default=8,
                    help="num_speculative_tokens of every speculating setting")
    sp.add_argument("--spec-rounds", type=int, default=1,
                    help="timed passes per setting, alternating settings (median kept)")
    sp.add_argument("--llama-spec", type=_llama_spec, default=DEFAULT_LLAMA_SPEC,
                    help="with --compare llamacpp: llama-server's speculation settings beside "
                         "off, comma-separated TYPE[:N] (TYPE ngram-simple, ngram-map-k or "
                         "ngram-mod; N the n-gram length it looks up; drafts of --spec-k "
                         f"tokens) (default: {DEFAULT_LLAMA_SPEC})")
    sp.add_argument("--spec-random-prompts", type=int, default=16,
                    help="requests of the W1 run after the chat families (0: skip W1 and W2)")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None,
                   help="JSON results (default: bench_results/<workload>-<UTC time>.json)")
    o.add_argument("--output-png", default=None, help="bar chart (default: next to the JSON)")


def validate_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "latency_iters", "latency_rounds", "threads", "llama_parallel", "prefix_len",
                 "max_concurrency", "spec_k", "spec_rounds", "hf_num_prompts"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.spec_families == ["none"] and not args.spec_random_prompts:
        raise ValueError("--spec-families none with --spec-random-prompts 0 leaves nothing to run")
    if args.spec_random_prompts < 0:
        raise ValueError(f"--spec-random-prompts must be >= 0, got {args.spec_random_prompts}")
    if max(args.spec_streams) > 8:
        raise ValueError(f"--spec-streams: each family has 8 prompts, got {args.spec_streams}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.eager_too and getattr(args, "enforce_eager", False):
        raise ValueError("--eager-too runs pagedllm once as configured and once with "
                         "--enforce-eager; drop --enforce-eager")
    if args.pagedllm_on_hf_subset and args.hf_num_prompts is None:
        raise ValueError("--pagedllm-on-hf-subset needs --hf-num-prompts N")
    if getattr(args, "device", "auto") == "cuda" and not _cuda_available():
        raise ValueError("--device cuda but torch sees no CUDA device; use --device cpu")
    llama = {"llamacpp", "llamabench"} & set(args.compare)
    if llama and not args.llama_server:
        args.llama_server = default_llama_server()
    if llama and not args.llama_server:
        raise ValueError(f"--compare {'/'.join(sorted(llama))} needs --llama-server PATH (a llama.cpp "
                         f"llama-server binary; llama-bench is taken from beside it; "
                         f"scripts/build_llamacpp.sh builds both)")
    if "llamabench" in args.compare and not default_llama_bench(args.llama_server):
        raise ValueError(f"--compare llamabench: no llama-bench beside {args.llama_server!r}")
    if args.latency_rounds > 1 and "llamabench" not in args.compare:
        raise ValueError("--latency-rounds alternates pagedllm and llama-bench: it needs "
                         "--compare llamabench")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise ValueError(f"--llama-server {args.llama_server!r} is not an executable file")


def build_workloads(args: argparse.Namespace,
                    id_range: tuple[int, int] = wl.TOKEN_ID_RANGE) -> list[wl.Workload]:
    names = ["throughput", "latency", "prefix"] if args.workload == "all" else [args.workload]
    out = []
    for name in names:
        if name == "throughput":
            make = wl.throughput_w1 if args.shape == "w1" else wl.throughput_nanovllm
            # nano-vllm's bench.py runs 256 requests of its shape
            default = 64 if args.shape == "w1" else 256
            kw: dict[str, Any] = {"seed": args.seed, "num_prompts": args.num_prompts or default}
            if args.shape == "w1":
                kw["id_range"] = id_range
            if args.input_len:
                kw["input_len"] = args.input_len
            if args.output_len:
                kw["output_len"] = args.output_len
            out.append(make(**kw))
        elif name == "latency":
            out.append(wl.latency_w2((args.input_len or (128, 128))[0],
                                     (args.output_len or (256, 256))[0], args.seed, id_range))
        elif name == "prefix":
            out.append(wl.prefix_w3(args.num_prompts or 32, args.prefix_len,
                                    (args.input_len or (32, 32))[0],
                                    (args.output_len or (32, 32))[0], args.seed, id_range))
        elif name == "serve":
            out.append(wl.throughput_w1(args.num_prompts or 64, args.input_len or (32, 512),
                                        args.output_len or (32, 256), args.seed, id_range))
    return out


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    # The bench's --dtype, --seed and --threads share names with engine fields: keep them out.
    config = EngineConfig.from_cli_args(args, model=args.model, dtype="auto", seed=0,
                                        num_threads=None)
    return {k: v for k, v in vars(config).items() if k != "model" and k not in _BENCH_OWNED}


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def bench_device(args: argparse.Namespace) -> str:
    """Where the engines run: --device, with auto resolved as the engine resolves it."""
    device = getattr(args, "device", "auto")
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return device


def resolve_dtypes(names: list[str], device: str = "cpu") -> list[str]:
    out = []
    for name in names:
        if name == "auto":
            name = str(EngineConfig(dtype="auto", device=device).torch_dtype).removeprefix("torch.")
        if name not in out:
            out.append(name)
    return out


def engine_dtype(dtype: str, names: list[str], device: str = "cpu") -> str:
    """The dtype the engine gets for the run of dtype (a resolve_dtypes name): "auto" where
    --dtype auto named it (GGUF weights then stay quantized, as a user who names no dtype
    gets, and as llama.cpp runs the same file), else dtype."""
    return "auto" if "auto" in names and resolve_dtypes(["auto"], device) == [dtype] else dtype


# ---- running -------------------------------------------------------------------------------

class Bench:
    """One bench run: the machine, the model's cost, then each engine in turn."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = bench_device(args)
        self.dtypes = resolve_dtypes(args.dtype, self.device)
        self.results: list[BenchResult] = []
        self.notes: list[str] = []
        from pagedllm.loader import default_model_path, load_model_source
        self.model_path = args.model or default_model_path()
        source = load_model_source(self.model_path)
        self.model_config, self.tokenizer = source.config, source.tokenizer
        self.workloads = build_workloads(args, wl.token_id_range(self.model_config.vocab_size))
        self.cost: ModelCost = model_cost(self.model_config)
        self.machine: MachineMeasurement | None = None
        self.load_at_start = [round(x, 2) for x in os.getloadavg()]
        self.failures: list[str] = []
        self.last_step = ""
        # called after every row (run_bench writes the JSON so far: a run cut short by a
        # timeout keeps the rows it finished)
        self.on_result: Callable[[], None] | None = None

    def plan(self) -> list[str]:
        """The steps of the run, for the progress bar."""
        engines = ["pagedllm"] + [p for p in PEERS if p in self.args.compare]
        steps = ["measure machine"]
        for dtype in self.dtypes:
            for engine in engines:
                for w in self.workloads:
                    if engine == "llamabench" and w.name != "latency":
                        continue
                    steps.append(f"{engine} {dtype} {w.name}")
                    if w.name == "prefix" and engine in ("pagedllm", "llamacpp"):
                        steps.append(f"{engine} {dtype} {w.name} (caching off)")
                    if engine == "pagedllm" and self.args.eager_too:
                        steps.append(f"{engine} {dtype} {w.name} (eager)")
                    if (engine == "pagedllm" and self.args.pagedllm_on_hf_subset
                            and self._hf_subset(w) is not w):
                        steps.append(f"{engine} {dtype} {w.name} (HF's subset)")
        return steps

    def run(self) -> None:
        with tqdm(total=len(self.plan()), desc="bench", unit="step", dynamic_ncols=True) as bar:
            self.bar = bar
            self._step("measure machine")
            self.machine = measure_machine(self.args.threads,
                                           [_torch_dtype(d) for d in self.dtypes],
                                           quick=self.args.quick_machine, device=self.device)
            bar.update(1)
            for dtype in self.dtypes:
                self._run_pagedllm(dtype)
                if "hf" in self.args.compare:
                    self._run_peer(dtype, lambda: self._hf_runner(dtype),
                                   workloads=[self._hf_subset(w) for w in self.workloads])
                if "llamacpp" in self.args.compare:
                    self._run_llamacpp(dtype)
                if ("llamabench" in self.args.compare and self._has("latency")
                        and self.args.latency_rounds == 1):  # (else run in turn with pagedllm's)
                    self._run_llama_bench(dtype)

    def _step(self, text: str) -> None:
        self.last_step = text
        self.bar.set_description(f"bench: {text}")
        self.bar.refresh()

    def _run_pagedllm(self, dtype: str) -> None:
        """The engine flags as given for every workload (and HF's subset of them with
        --pagedllm-on-hf-subset); W3 again with prefix caching flipped; with --eager-too
        every workload again with enforce_eager, in an engine loaded after the first is freed."""
        caching = getattr(self.args, "enable_prefix_caching", True)
        eager = self.args.eager_too
        subsets = ([self._hf_subset(w) for w in self.workloads if self._hf_subset(w) is not w]
                   if self.args.pagedllm_on_hf_subset else [])
        self._run_peer(dtype, lambda: self._pagedllm_runner(dtype, caching, eager=False),
                       workloads=self.workloads + subsets,
                       prefix_label=f"prefix caching {'on' if caching else 'off'}")
        if self._has("prefix"):
            self._run_peer(dtype, lambda: self._pagedllm_runner(dtype, not caching, eager=False),
                           workloads=self._only("prefix"),
                           prefix_label=f"prefix caching {'on' if not caching else 'off'}")
        if eager:
            self._run_peer(dtype, lambda: self._pagedllm_runner(dtype, caching, eager=True),
                           workloads=self.workloads + subsets,
                           prefix_label=f"prefix caching {'on' if caching else 'off'}")

    def _pagedllm_runner(self, dtype: str, caching: bool, eager: bool) -> Runner:
        """pagedllm with the engine flags; eager: the --eager-too run (enforce_eager), whose
        rows and those of the run it is compared with carry their executor as a label."""
        from pagedllm.bench.pagedllm_runner import PagedLLMRunner
        self._step(f"loading pagedllm {dtype}{' (eager)' if eager else ''} on {self.device}")
        kwargs = {**engine_kwargs(self.args), "device": self.device,
                  "enable_prefix_caching": caching}
        if eager:
            kwargs["enforce_eager"] = True
        runner = PagedLLMRunner(self.args.model, dtype, self.args.threads, kwargs,
                                self.args.structured_output,
                                engine_dtype(dtype, self.args.dtype, self.device))
        if self.args.eager_too:
            runner.label = runner.executor()
        return runner

    def _hf_runner(self, dtype: str) -> Runner:
        from pagedllm.bench.hf_runner import HFRunner
        self._step(f"loading HF transformers {dtype} on {self.device}")
        return HFRunner(self.model_path, dtype, self.args.threads, self.args.hf_batch_sizes,
                        self.device)

    def _hf_subset(self, w: wl.Workload) -> wl.Workload:
        return hf_subset(w, self.args.hf_num_prompts)

    def _run_llamacpp(self, dtype: str) -> None:
        """llama.cpp's server with its prompt cache on; W3 again with it off."""
        from pagedllm.bench.llamacpp_runner import LlamaCppRunner
        gguf = self._llama_gguf(dtype)
        ctx = max(w.max_seq_len for w in self.workloads)
        for on in ([True, False] if self._has("prefix") else [True]):
            self._run_peer(dtype, lambda: LlamaCppRunner(
                self.args.llama_server, gguf, dtype, self.args.threads, self.args.llama_parallel,
                ctx, cache_prompt=on, user_gguf=gguf in (self.args.llama_gguf, self.model_path),
                kv_dtype=self._kv_dtype(dtype), repack=not self.args.llama_no_repack),
                workloads=None if on else self._only("prefix"),
                prefix_label=f"prompt cache {'on' if on else 'off'}")

    def _run_llama_bench(self, dtype: str) -> None:
        """llama.cpp's llama-bench on the latency request (it serves no other workload)."""
        self._run_peer(dtype, lambda: self._llama_bench_runner(dtype),
                       workloads=self._only("latency"))

    def _llama_bench_runner(self, dtype: str) -> Runner:
        from pagedllm.bench.llamacpp_runner import LlamaBenchRunner
        gguf = self._llama_gguf(dtype)
        return LlamaBenchRunner(
            default_llama_bench(self.args.llama_server), gguf, dtype, self.args.threads,
            user_gguf=gguf in (self.args.llama_gguf, self.model_path), kv_dtype=self._kv_dtype(dtype),
            repack=not self.args.llama_no_repack)

    def _latency_in_rounds(self, dtype: str, w: wl.Workload, runner: Runner) -> list[BenchResult]:
        """--latency-rounds: the latency request on pagedllm (runner, loaded) and llama-bench
        in turn, round after round; each engine's runs pooled (median kept), each round's
        decode ratio kept in pagedllm's settings and in the notes."""
        peer = self._llama_bench_runner(dtype)
        rounds = self.args.latency_rounds
        ours: list[LatencyRun] = []
        theirs: list[LatencyRun] = []
        for i in range(rounds):
            self._step(f"{runner.engine} {dtype} latency, round {i + 1} of {rounds}")
            ours.append(runner.latency(w, self.args.latency_iters))
            self._step(f"{peer.engine} {dtype} latency, round {i + 1} of {rounds}")
            theirs.append(peer.latency(w, self.args.latency_iters))
        ratios = [round(statistics.median(a.decode_tok_s) / statistics.median(b.decode_tok_s), 3)
                  for a, b in zip(ours, theirs)]
        mine, peers = (latency_result(w, pooled(runs), r)
                       for runs, r in ((ours, runner), (theirs, peer)))
        for result in (mine, peers):
            result.settings["rounds"] = rounds
        mine.settings["decode_vs_llama_bench_by_round"] = ratios
        self.notes.append(f"{dtype} latency in {rounds} alternating rounds: pagedllm / "
                          f"llama-bench decode tok/s by round {ratios} (median "
                          f"{statistics.median(ratios):.3f}); pooled medians "
                          f"{mine.decode_tok_s:.1f} / {peers.decode_tok_s:.1f}")
        peer.close()
        return [mine, peers]

    def _llama_gguf(self, dtype: str) -> str:
        """The file llama.cpp runs at dtype: --llama-gguf; else the model's own GGUF where
        pagedllm kept its weights quantized (as it did at dtype, or as --dtype auto does),
        the same weights in the same file; else the model converted to dtype (cached)."""
        if self.args.llama_gguf:
            return self.args.llama_gguf
        if self.model_path.endswith(".gguf"):
            ran = [r.settings.get("quantization") for r in self.results
                   if r.engine == "pagedllm" and r.dtype == dtype]
            if "gguf" in ran or (not ran and engine_dtype(dtype, self.args.dtype,
                                                          self.device) == "auto"):
                return self.model_path
        return gguf_for_dtype(self.model_path, dtype)

    def _kv_dtype(self, dtype: str) -> str:
        """The KV cache dtype pagedllm ran with at dtype (its engine's resolved setting), for
        the peers' cache; the option as given, or dtype, where pagedllm did not run."""
        for r in self.results:
            if r.engine == "pagedllm" and r.dtype == dtype and r.settings.get("kv_cache_dtype"):
                return r.settings["kv_cache_dtype"]
        return dtype if self.args.kv_cache_dtype in (None, "auto") else self.args.kv_cache_dtype

    def _has(self, name: str) -> bool:
        return any(w.name == name for w in self.workloads)

    def _only(self, name: str) -> list[wl.Workload]:
        return [w for w in self.workloads if w.name == name]

    def _run_peer(self, dtype: str, make: Any, workloads: list[wl.Workload] | None = None,
                  prefix_label: str = "") -> None:
        """Load one engine, warm it up, run the workloads on it, free it. With --keep-going
        a failure is noted and the engine's memory freed instead of ending the run."""
        failures = len(self.failures)
        try:
            self._run_engine(dtype, make, workloads, prefix_label)
        except Exception as e:
            if not self.args.keep_going:
                raise
            what = f"{self.last_step}: {type(e).__name__}: {e}"
            self.failures.append(what)
            print(f"pagedllm bench: an engine failed, going on (--keep-going): {what}",
                  file=sys.stderr)
            traceback.print_exc()
        if len(self.failures) > failures:  # out of the except block: its frames are gone
            _free_device_memory(self.device)

    def _run_engine(self, dtype: str, make: Any, workloads: list[wl.Workload] | None,
                    prefix_label: str) -> None:
        self._step(f"loading {dtype} engine")
        runner: Runner = make()
        try:
            if self.args.warmup:
                self._step(f"{runner.engine} {dtype} warm-up")
                runner.warmup(wl.warmup_workload(
                    id_range=wl.token_id_range(self.model_config.vocab_size), device=self.device))
            for w in workloads or self.workloads:
                self._step(f"{runner.engine} {dtype} {w.name} {wl.subset_label(w)}".rstrip())
                if (w.name == "latency" and self.args.latency_rounds > 1
                        and runner.engine == "pagedllm"):
                    results = self._latency_in_rounds(dtype, w, runner)
                elif w.name == "latency":
                    results = [latency_result(w, runner.latency(w, self.args.latency_iters),
                                              runner)]
                else:
                    results = [throughput_result(w, runner.throughput(w), runner)]
                for result in results:
                    add_labels(result, w, prefix_label)
                    assert self.machine is not None
                    add_roofline(result, w, self.cost, self.machine)
                    self.results.append(result)
                    if self.on_result is not None:
                        self.on_result()
                    self.bar.update(1)
        finally:
            runner.close()

    # ---- output ---------------------------------------------------------------------------

    def document(self, started: str, argv: list[str]) -> dict[str, Any]:
        from pagedllm.bench.pagedllm_runner import pagedllm_version
        import torch
        info = machine_info(self.device)
        info["load_average_at_start"] = self.load_at_start
        return {
            "schema": SCHEMA, "started": started,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": ["pagedllm", "bench", *argv], "device": self.device,
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith(("PAGEDLLM_", "CUDA_VISIBLE_DEVICES"))},
            "machine": info, "hardware": self.machine.summary() if self.machine else None,
            "versions": {"pagedllm": pagedllm_version(), "torch": torch.__version__,
                         **_peer_versions(self.device, self.args.compare)},
            "model": {"name": self.model_config.name or self.model_config.architecture,
                      "path": self.model_path, "cost": self.cost.summary()},
            "workloads": [w.summary() for w in self.workloads],
            "results": [r.to_dict() for r in self.results],
            "failures": self.failures,
            "notes": self.notes,
        }


def hf_subset(w: wl.Workload, hf_num_prompts: int | None) -> wl.Workload:
    """What HF transformers runs of w: its first --hf-num-prompts requests (throughput and
    prefix workloads; W2 is one request)."""
    if w.name == "latency":
        return w
    return wl.first_requests(w, hf_num_prompts)


def add_labels(result: BenchResult, w: wl.Workload, prefix_label: str = "") -> None:
    """Say in the row's label what tells it from its neighbours: prefix caching on or off
    (W3), and a subset of the workload's requests (with the subset's size in settings)."""
    extra = [prefix_label if w.name == "prefix" else "", wl.subset_label(w)]
    result.settings["label"] = ", ".join(filter(None, [result.settings.get("label"), *extra]))
    if not result.settings["label"]:
        del result.settings["label"]
    if "first_requests" in w.params:
        result.settings["workload_subset"] = {
            "first_requests": w.params["first_requests"], "of_requests": w.params["of_requests"],
            "prompt_tokens": w.num_prompt_tokens, "output_tokens": w.num_output_tokens}


def add_roofline(result: BenchResult, w: wl.Workload, cost: ModelCost,
                 machine: MachineMeasurement) -> None:
    """The row's roofline from the machine's measured matmul rate (of the row's dtype) and
    bandwidth: W2's decode steps one by one, else the whole workload (roofline.py)."""
    peak = machine.matmul_gflops.get(result.dtype)
    if peak is None:
        return
    bw, itemsize = machine.bandwidth_gbs, _torch_dtype(result.dtype).itemsize
    # the KV cache's type: pagedllm's kv_cache_dtype, llama.cpp's cache type
    kv = result.settings.get("kv_cache_dtype") or result.settings.get("kv_cache_type")
    if w.name == "latency":
        r = w.requests[0]
        steps = range(r.prompt_len + 1, r.prompt_len + r.output_len)
        weight_bytes = result.settings.get("weight_bytes")  # quantized weights: their bytes
        decode_s = sum(decode_step_roofline_seconds(cost, c, itemsize, peak, bw, weight_bytes, kv)
                       for c in steps)
        bound_tok_s = len(steps) / decode_s if decode_s else None
        ttft_bound = prefill_roofline_seconds(cost, r.prompt_len, peak)
        result.roofline = {"tok_s": bound_tok_s, "decode_seconds": decode_s,
                           "ttft_seconds": ttft_bound, "peak_gflops": peak, "bandwidth_gbs": bw,
                           "device": machine.device,
                           "ttft_fraction": ttft_bound / result.ttft_s if result.ttft_s else None}
        if bound_tok_s and result.decode_tok_s:
            result.roofline_fraction = result.decode_tok_s / bound_tok_s
        return
    roof = workload_roofline(cost, w, itemsize, peak, bw, kv)
    result.roofline = {**roof.summary(), "tok_s": w.num_output_tokens / roof.seconds,
                       "serial_tok_s": w.num_output_tokens / roof.serial_seconds,
                       "device": machine.device}
    if result.elapsed_s:
        result.roofline_fraction = roof.seconds / result.elapsed_s
        result.serial_fraction = roof.serial_seconds / result.elapsed_s


def _peer_versions(device: str, compare: list[str]) -> dict[str, str]:
    """Versions that decide the figures beside torch's: CUDA and Triton on the GPU,
    transformers with --compare hf."""
    out: dict[str, str] = {}
    if device == "cuda":
        import torch
        out["cuda"] = str(torch.version.cuda)
        try:
            import triton
            out["triton"] = triton.__version__
        except ImportError:
            out["triton"] = "not installed"
    if "hf" in compare:
        try:
            import transformers
            out["transformers"] = transformers.__version__
        except ImportError:
            out["transformers"] = "not installed"
    return out


def _free_device_memory(device: str) -> None:
    """What a failed engine held, back to the driver (the next engine's KV budget is a
    fraction of the free memory)."""
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()


def _torch_dtype(name: str) -> "Any":
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def default_output_path(workload: str, started: datetime) -> str:
    return os.path.join("bench_results", f"{workload}-{started.strftime('%Y%m%d-%H%M%S')}.json")


def spec_engine_dtype(names: list[str]) -> str:
    """The engine's dtype in `bench spec`: that of the first dtype named (engine_dtype)."""
    return engine_dtype(resolve_dtypes(names)[0], names)


def llama_spec_peer(args: argparse.Namespace, model_path: str, cases: list) -> Any:
    """llama.cpp's server under "off" and each --llama-spec setting (None without
    --compare llamacpp). Its GGUF: --llama-gguf, else the model's own GGUF file where the
    engine keeps GGUF weights quantized (--dtype auto), else the model converted to the dtype."""
    if "llamacpp" not in args.compare:
        return None
    from pagedllm.bench.spec_llamacpp import LlamaSpecPeer, parse_llama_spec
    dtype = resolve_dtypes(args.dtype)[0]
    gguf = args.llama_gguf
    if gguf is None:
        gguf = model_path if (spec_engine_dtype(args.dtype) == "auto"
                              and model_path.endswith(".gguf")) else gguf_for_dtype(model_path, dtype)
    return LlamaSpecPeer(args.llama_server, gguf, dtype, args.threads, max(args.spec_streams),
                         max(r.prompt_len + r.output_len for c in cases for r in c.requests),
                         parse_llama_spec(args.llama_spec), args.spec_k,
                         user_gguf=args.llama_gguf is not None, repack=not args.llama_no_repack)


def run_spec(args: argparse.Namespace, argv: list[str], started: datetime) -> int:
    """`bench spec`: the chat families and W1 / W2 under each speculation setting (and
    llama.cpp's server under its own n-gram speculation with --compare llamacpp)."""
    from pagedllm.bench.spec import SpecBench, build_cases
    from pagedllm.bench.pagedllm_runner import pagedllm_version
    from pagedllm.loader import default_model_path, load_model_source
    model_path = args.model or default_model_path()
    source = load_model_source(model_path)
    max_len = (args.output_len or (256, 256))[1]
    families = [f for f in args.spec_families if f != "none"]
    cases = build_cases(source.tokenizer, families, args.spec_streams, max_len,
                        args.spec_random_prompts, source.config.vocab_size)
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k != "speculative_config"}
    kwargs.update(dtype=spec_engine_dtype(args.dtype), num_threads=args.threads,
                  enable_prefix_caching=False)
    if kwargs.get("kv_cache_memory_bytes") is None:
        kwargs["kv_cache_memory_bytes"] = 1 << 30   # three engines may be alive at once
    peer = llama_spec_peer(args, model_path, cases)
    bench = SpecBench(args.model, kwargs, args.spec_settings, args.spec_k, args.spec_rounds, peer)
    try:
        rows = bench.run(cases)
    finally:
        bench.close()
    info = machine_info()
    info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    doc = {"schema": SCHEMA, "started": started.isoformat(timespec="seconds"),
           "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": ["pagedllm", "bench", *argv], "machine": info,
           "versions": {"pagedllm": pagedllm_version(),
                        **({"llama.cpp": peer.version} if peer is not None else {})},
           "model": {"name": source.config.name or source.config.architecture,
                     "path": model_path},
           "engine": {k: v for k, v in kwargs.items() if v is not None},
           "spec": {"settings": args.spec_settings, "num_speculative_tokens": args.spec_k,
                    "rounds": args.spec_rounds},
           **({"llamacpp": peer.describe()} if peer is not None else {}),
           "workloads": [{**c.workload.summary(), "streams": c.streams} for c in cases],
           "results": [r.to_dict() for r in rows]}
    json_path = args.output_json or default_output_path("spec", started)
    write_json(doc, json_path)
    print(format_spec_table(rows))
    print(f"results: {json_path}")
    # pagedllm's speculation must keep its greedy tokens; a peer's is reported, not judged
    differ = [r for r in rows if r.same_tokens_as_off is False and r.engine == "pagedllm"]
    for r in differ:
        print(f"pagedllm bench: error: {r.speculation} changed the greedy tokens of "
              f"{r.workload} x{r.streams}", file=sys.stderr)
    return 1 if differ else 0


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    validate_args(args)
    started = datetime.now(timezone.utc)
    if args.workload == "spec":
        return run_spec(args, argv, started)
    bench = Bench(args)
    json_path = args.output_json or default_output_path(args.workload, started)

    def write_partial() -> None:
        doc = bench.document(started.isoformat(timespec="seconds"), argv)
        doc["partial"] = True  # overwritten by the whole run's document at its end
        write_json(doc, json_path)

    bench.on_result = write_partial
    if args.workload == "serve":
        result, notes = run_serve(args, bench.workloads[0], bench.tokenizer)
        bench.results.append(result)
        bench.notes.extend(notes)
    else:
        bench.run()
    speedups_over_eager(bench.results)
    doc = bench.document(started.isoformat(timespec="seconds"), argv)
    png_path = args.output_png or os.path.splitext(json_path)[0] + ".png"
    chart_problem = write_chart(bench.results, png_path, _chart_title(doc))
    if chart_problem:
        bench.notes.append(chart_problem)
    doc["notes"] = bench.notes
    doc["outputs"] = {"json": json_path, "png": None if chart_problem else png_path}
    write_json(doc, json_path)
    print(format_machine(doc) if doc["hardware"] else "")
    print(format_table(bench.results))
    bounds = format_bounds(bench.results)
    if bounds:
        print(bounds)
    serving = format_serving(bench.results)
    if serving:
        print(serving)
    comparisons = format_comparisons(bench.results)
    if comparisons:
        print(comparisons)
    for note in bench.notes:
        print(f"note: {note}")
    print(f"results: {json_path}" + ("" if chart_problem else f", chart: {png_path}"))
    inexact = [r for r in bench.results if not r.exact_output_lens]
    for r in inexact:
        print(f"pagedllm bench: error: {r.engine} {r.dtype} on {r.workload} produced "
              f"{r.output_tokens} tokens, {r.requested_output_tokens} were requested", file=sys.stderr)
    for failure in bench.failures:
        print(f"pagedllm bench: error: an engine failed: {failure}", file=sys.stderr)
    return 1 if inexact or bench.failures else 0


def _chart_title(doc: dict[str, Any]) -> str:
    m, hw = doc["machine"], doc["hardware"] or {}
    where = (f"{m.get('gpu', '?')} (CUDA {m.get('cuda')})" if doc.get("device") == "cuda"
             else f"{hw.get('threads', '?')} threads of {m.get('cpu', '?')}")
    return (f"{doc['model']['name']}, {where}\n"
            f"{doc['started']}, pagedllm {doc['versions']['pagedllm']}")
