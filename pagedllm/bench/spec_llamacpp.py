"""llama.cpp's own speculative decoding beside pagedllm's in `pagedllm bench spec`.

llama-server offers model-free n-gram speculation (`--spec-type`). Two of its kinds match
pagedllm's proposers:

- ngram-simple: the last n tokens looked up in the request's own prompt and output, the
  tokens after the latest earlier occurrence drafted: prompt lookup, as pagedllm's "ngram"
  (which tries n = 4 down to 1; llama.cpp takes one n, and drafts only where at least n
  tokens follow the match).
- ngram-mod: a hash of every n-gram seen -> the token after it, one pool shared by all slots
  and kept across requests, drafts chained token by token: closer to pagedllm's "suffix"
  (a global structure over earlier requests). Because the pool outlives a request, each
  ngram-mod measurement gets a fresh server, as each suffix measurement gets a fresh engine.

A setting reads "TYPE:N" (N the looked-up n-gram length); the draft length is the bench's
--spec-k (ngram-simple's and ngram-map-k's m-gram, ngram-mod's n_max). Requests go to
/completion as token ids, greedy, prompt cache off (pagedllm runs prefix caching off), EOS
honoured unless the case ignores it; acceptance comes from each response's "timings"
(draft_n, draft_n_accepted) and the number of drafts from the server's /metrics counters.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedllm.bench.llamacpp_runner import LlamaCppRunner

ENGINE = "llama.cpp"
# type -> (flag of the looked-up n-gram length, flag of the draft length, default N)
_TYPE_FLAGS = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m", 4),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m", 4),
    "ngram-mod": ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max", 24),
}
LLAMA_SPEC_TYPES = tuple(_TYPE_FLAGS)
DEFAULT_LLAMA_SPEC = "ngram-simple:4,ngram-mod:24"
_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total")


@dataclass(frozen=True)
class LlamaSpecSetting:
    """One llama-server configuration: speculation off, or one n-gram type."""

    spec_type: str                 # "off" or one of LLAMA_SPEC_TYPES
    lookup: int = 0                # looked-up n-gram length (0 with "off")

    @property
    def label(self) -> str:
        return "off" if self.spec_type == "off" else f"{self.spec_type}:{self.lookup}"

    @property
    def fresh_server_each_run(self) -> bool:
        """ngram-mod's pool outlives requests: an earlier round's answers would be in it."""
        return self.spec_type == "ngram-mod"

    def server_args(self, k: int) -> list[str]:
        """llama-server flags of this setting with drafts of at most k tokens."""
        if self.spec_type == "off":
            return []
        lookup_flag, draft_flag, _ = _TYPE_FLAGS[self.spec_type]
        args = ["--spec-type", self.spec_type, lookup_flag, str(self.lookup), draft_flag, str(k)]
        if self.spec_type == "ngram-mod":
            # its default minimum draft (48) exceeds any k we use: accept any chain length
            args += ["--spec-ngram-mod-n-min", "1"]
        return args


def parse_llama_spec(text: str) -> list[LlamaSpecSetting]:
    """"ngram-simple:4,ngram-mod" -> [off, ngram-simple:4, ngram-mod:24]: "off" always
    first (every speedup is against it), N defaulting per type."""
    settings = [LlamaSpecSetting("off")]
    for item in (t.strip() for t in text.split(",")):
        if not item or item == "off":
            continue
        kind, _, n = item.partition(":")
        if kind not in _TYPE_FLAGS:
            raise ValueError(f"unknown llama.cpp speculation {item!r}; known: "
                             f"{', '.join(LLAMA_SPEC_TYPES)} (each optionally :N, the n-gram length)")
        if n and not (n.isdigit() and int(n) > 0):
            raise ValueError(f"llama.cpp speculation {item!r}: N must be a positive integer")
        setting = LlamaSpecSetting(kind, int(n) if n else _TYPE_FLAGS[kind][2])
        if setting not in settings:
            settings.append(setting)
    return settings


@dataclass
class LlamaCompletion:
    """What one /completion response says about the tokens it produced."""

    token_ids: list[int]
    stop_type: str                 # "eos", "limit", ...
    prompt_n: int                  # prompt tokens computed (not taken from a cache)
    cache_n: int                   # prompt tokens taken from the server's cache
    draft_n: int                   # tokens drafted
    draft_n_accepted: int
    predicted_per_second: float | None

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> "LlamaCompletion":
        if "tokens" not in body:
            raise RuntimeError("llama-server returned no token ids (\"tokens\"): it is too old "
                               "for return_tokens; rebuild it with scripts/build_llamacpp.sh")
        t = body.get("timings", {})
        tokens = [int(x) for x in body["tokens"]]
        if len(tokens) != int(body.get("tokens_predicted", len(tokens))):
            raise RuntimeError(f"llama-server returned {len(tokens)} token ids but says it "
                               f"predicted {body['tokens_predicted']}")
        return cls(tokens, str(body.get("stop_type", "")), int(t.get("prompt_n", 0)),
                   int(t.get("cache_n", 0)), int(t.get("draft_n", 0)),
                   int(t.get("draft_n_accepted", 0)), t.get("predicted_per_second"))

    def summary(self) -> dict[str, Any]:
        return {"output_tokens": len(self.token_ids), "stop_type": self.stop_type,
                "prompt_n": self.prompt_n, "cache_n": self.cache_n, "draft_n": self.draft_n,
                "draft_n_accepted": self.draft_n_accepted,
                "acceptance_rate": self.draft_n_accepted / self.draft_n if self.draft_n else None,
                "predicted_per_second": self.predicted_per_second}


@dataclass
class LlamaMeasurement:
    """One pass of a case on one server: wall seconds, each request's completion, and the
    server's speculation counters over the pass."""

    seconds: float
    completions: list[LlamaCompletion]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class LlamaSpecPeer:
    """llama-server under each setting, started lazily and kept (ngram-mod: one per pass)."""

    def __init__(self, binary: str, gguf: str, dtype: str, threads: int, parallel: int,
                 max_seq_len: int, settings: list[LlamaSpecSetting], k: int,
                 user_gguf: bool = False, repack: bool = True) -> None:
        self.binary, self.gguf, self.dtype, self.threads = binary, gguf, dtype, threads
        self.repack = repack
        self.parallel, self.max_seq_len, self.k, self.user_gguf = parallel, max_seq_len, k, user_gguf
        self.settings = {s.label: s for s in settings}
        self._servers: dict[str, LlamaCppRunner] = {}
        self.commands: dict[str, list[str]] = {}
        self.version = ""

    def server(self, label: str) -> LlamaCppRunner:
        setting = self.settings[label]
        if setting.fresh_server_each_run or label not in self._servers:
            self._stop(label)
            runner = LlamaCppRunner(self.binary, self.gguf, self.dtype, self.threads,
                                    self.parallel, self.max_seq_len, cache_prompt=False,
                                    user_gguf=self.user_gguf, repack=self.repack,
                                    extra_args=("--metrics", *setting.server_args(self.k)))
            runner.complete_tokens(list(range(1000, 1024)), 4, ignore_eos=True)  # first-shape costs
            self._servers[label] = runner
            self.commands[label] = runner.cmd
            self.version = runner.versions()[ENGINE]
        return self._servers[label]

    def measure(self, label: str, prompts: list[list[int]], max_tokens: list[int],
                ignore_eos: bool, concurrent: bool) -> LlamaMeasurement:
        """The requests one after another, or all at once (concurrent)."""
        server = self.server(label)
        before = server.metrics()

        def one(i: int) -> LlamaCompletion:
            return LlamaCompletion.from_response(
                server.complete_tokens(prompts[i], max_tokens[i], ignore_eos))

        start = time.perf_counter()
        if concurrent:
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                completions = list(pool.map(one, range(len(prompts))))
        else:
            completions = [one(i) for i in range(len(prompts))]
        seconds = time.perf_counter() - start
        after = server.metrics()
        drafts, drafted, accepted = (int(after.get(c, 0) - before.get(c, 0)) for c in _COUNTERS)
        return LlamaMeasurement(seconds, completions, drafts, drafted, accepted)

    def describe(self) -> dict[str, Any]:
        """For the JSON: the binary, its version and every server's command line."""
        return {"binary": self.binary, "version": self.version, "gguf": self.gguf,
                "kv_cache_dtype": self.dtype, "parallel_slots": self.parallel, "k": self.k,
                "commands": self.commands}

    def _stop(self, label: str) -> None:
        runner = self._servers.pop(label, None)
        if runner is not None:
            runner.close()

    def close(self) -> None:
        for label in list(self._servers):
            self._stop(label)
