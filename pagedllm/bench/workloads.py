"""The benchmark workloads: seeded, deterministic lists of (prompt token ids, output length).

Every request is run with EOS ignored and ``max_tokens`` equal to its output length, so
every engine produces exactly the same number of tokens and tokens/s compare fairly.
Token ids are drawn at random (as in vLLM's and nano-vllm's random datasets): the text is
meaningless, the cost is not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench.spec_prompts import FAMILIES

# W1 draws token ids from this range: clear of the special and byte tokens of small vocabularies.
TOKEN_ID_RANGE = (1000, 40000)


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """TOKEN_ID_RANGE cut to a smaller vocabulary (Mistral's and Mixtral's 32000); the same
    range, so the same workloads, for every vocabulary of 40000 tokens or more."""
    return TOKEN_ID_RANGE[0], min(TOKEN_ID_RANGE[1], vocab_size)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    # Leading prompt tokens shared with other requests of the workload (W3); the roofline
    # counts them once.
    shared_prefix_len: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """A named list of requests plus the parameters that generated it."""

    name: str
    description: str
    requests: list[BenchRequest]
    params: dict = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(r.prompt_len + r.output_len for r in self.requests)

    def summary(self) -> dict:
        return {"name": self.name, "description": self.description, "params": self.params,
                "num_requests": len(self.requests), "prompt_tokens": self.num_prompt_tokens,
                "output_tokens": self.num_output_tokens, "max_seq_len": self.max_seq_len}


def first_requests(workload: Workload, n: int | None) -> Workload:
    """The workload cut to its first n requests (all of them when n is None or not fewer),
    each with its own prompt and output length, for a peer too slow to run them all; its
    params say which subset it is."""
    if n is None or n >= len(workload.requests):
        return workload
    if n < 1:
        raise ValueError(f"a subset needs at least 1 request, got {n}")
    total = len(workload.requests)
    return Workload(workload.name, f"first {n} of: {workload.description}",
                    workload.requests[:n],
                    {**workload.params, "first_requests": n, "of_requests": total})


def subset_label(workload: Workload) -> str:
    """"first 64 of 256 requests" for a first_requests subset, else ""."""
    p = workload.params
    return f"first {p['first_requests']} of {p['of_requests']} requests" if "first_requests" in p else ""


def _check_range(name: str, lo: int, hi: int) -> None:
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}..{hi}")


def _random_ids(rng: np.random.Generator, n: int, id_range: tuple[int, int]) -> list[int]:
    return rng.integers(id_range[0], id_range[1], size=n).tolist()


def random_workload(name: str, num_prompts: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], seed: int,
                    id_range: tuple[int, int] = TOKEN_ID_RANGE) -> Workload:
    """Lengths uniform in the inclusive ranges, token ids uniform in ``[id_range)``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    _check_range("input length", *input_len)
    _check_range("output length", *output_len)
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts)
    requests = [BenchRequest(_random_ids(rng, int(p), id_range), int(o))
                for p, o in zip(prompt_lens, output_lens)]
    params = {"num_prompts": num_prompts, "input_len": list(input_len),
              "output_len": list(output_len), "token_id_range": list(id_range), "seed": seed}
    desc = (f"{num_prompts} requests, prompt {input_len[0]}-{input_len[1]}, "
            f"output {output_len[0]}-{output_len[1]} tokens")
    return Workload(name, desc, requests, params)


def throughput_w1(num_prompts: int = 64, input_len: tuple[int, int] = (32, 512),
                  output_len: tuple[int, int] = (32, 256), seed: int = 0,
                  id_range: tuple[int, int] = TOKEN_ID_RANGE) -> Workload:
    """W1 of issue 3: the offline throughput workload engines are compared on."""
    return random_workload("throughput", num_prompts, input_len, output_len, seed, id_range)


def throughput_nanovllm(num_prompts: int = 256, input_len: tuple[int, int] = (100, 1024),
                        output_len: tuple[int, int] = (100, 1024), seed: int = 0) -> Workload:
    """nano-vllm's bench.py shape: 100-1024 tokens in and out, token ids in [0, 10000]."""
    return random_workload("throughput-nanovllm", num_prompts, input_len, output_len, seed,
                           id_range=(0, 10001))


def latency_w2(input_len: int = 128, output_len: int = 256, seed: int = 0,
               id_range: tuple[int, int] = TOKEN_ID_RANGE) -> Workload:
    """W2: one request, for time to first token and single-stream decode speed."""
    w = random_workload("latency", 1, (input_len, input_len), (output_len, output_len), seed,
                        id_range)
    return Workload("latency", f"1 request, prompt {input_len}, output {output_len} tokens",
                    w.requests, w.params)


def prefix_w3(num_prompts: int = 32, prefix_len: int = 1024, suffix_len: int = 32,
              output_len: int = 32, seed: int = 0,
              id_range: tuple[int, int] = TOKEN_ID_RANGE) -> Workload:
    """W3: requests sharing one prefix, each with its own suffix: prefix caching at work."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    _check_range("prefix length", prefix_len, prefix_len)
    _check_range("suffix length", suffix_len, suffix_len)
    _check_range("output length", output_len, output_len)
    rng = np.random.default_rng(seed)
    prefix = _random_ids(rng, prefix_len, id_range)
    requests = [BenchRequest(prefix + _random_ids(rng, suffix_len, id_range), output_len,
                             shared_prefix_len=prefix_len) for _ in range(num_prompts)]
    params = {"num_prompts": num_prompts, "prefix_len": prefix_len, "suffix_len": suffix_len,
              "output_len": output_len, "token_id_range": list(id_range), "seed": seed}
    desc = (f"{num_prompts} requests, shared {prefix_len}-token prefix + {suffix_len}-token "
            f"suffix, output {output_len} tokens")
    return Workload("prefix", desc, requests, params)


# The speculation settings `bench spec` compares by default (bench/spec.py:
# speculative_config); it also takes "self:N" (the target's first N layers draft) and
# "draft:PATH" (a draft model with the target's tokenizer).
SPEC_SETTINGS = ("off", "ngram", "suffix")


def spec_workload(family: str, tokenizer: Any, max_output_len: int = 256) -> Workload:
    """A family of fixed chat prompts (bench/spec_prompts.py: code-edit, summarize-extract,
    multi-turn, agent) through the model's chat template. Unlike the random workloads the
    answers end at EOS: output_len is a cap, and the same greedy tokens come out of every
    speculation setting, so tokens/s still compare."""
    if family not in FAMILIES:
        raise ValueError(f"unknown speculative-decoding family {family!r}; "
                         f"known: {', '.join(FAMILIES)}")
    if max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_output_len}")
    requests = [BenchRequest(tokenizer.encode(tokenizer.apply_chat_template(conversation),
                                              add_special_tokens=False), max_output_len)
                for conversation in FAMILIES[family]()]
    params = {"family": family, "max_output_len": max_output_len, "ignore_eos": False}
    desc = f"{len(requests)} chat prompts ({family}), answers up to {max_output_len} tokens"
    return Workload(family, desc, requests, params)


def warmup_workload(seed: int = 12345, id_range: tuple[int, int] = TOKEN_ID_RANGE,
                    device: str = "cpu") -> Workload:
    """A few short requests run before timing (lazy initialisation, compilation, caches).

    Its token ids come from another seed, so it never warms the prefix cache for W3. On
    CUDA it is 16 requests of up to 1024 prompt tokens (a second of GPU time): the Triton
    kernels compile for each shape class they meet, and prompts over one step's budget,
    prefix chunks and decode batches beyond 8 rows should meet theirs before the clock runs.
    """
    if device == "cuda":
        return random_workload("warmup", 16, (16, 1024), (4, 24), seed, id_range)
    return random_workload("warmup", 2, (16, 48), (4, 8), seed, id_range)
