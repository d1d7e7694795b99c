"""Speculative decoding (n-gram and suffix proposals) in the engine: greedy outputs equal
plain decoding token for token (fp32, bundled model) under prefix caching, chunked prefill,
preemption, mixed batches and n > 1; stops land where they would without speculation;
seeded sampling is reproducible; suffix decoding learns from finished requests."""
from __future__ import annotations


import json

import pytest

from decode_stack_counts import counting_stack_steps  # tests/ (pytest prepends the rootdir)
from engine_cache import bounded_engine_cache  # tests/ (pytest prepends the rootdir)
from pagedllm import LLM, SamplingParams, StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
SPECS = {"ngram": NGRAM, "suffix": SUFFIX}
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4   # one 16-token block of SmolLM2's fp32 KV
CODE = (
    "def merge_sort(values):\n    if len(values) <= 1:\n        return values\n"
    "    middle = len(values) // 2\n    left = merge_sort(values[:middle])\n"
    "    right = merge_sort(values[middle:])\n    merged = []\n    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n            i += 1\n        else:\n"
    "            merged.append(right[j])\n            j += 1\n    return merged\n")
PROMPTS = [
    "Rewrite this function, renaming values to items:\n" + CODE + "\nRewritten:\n",
    "Copy the list exactly: red, green, blue, red, green, blue, red, green, blue. Copy:",
    "The quick brown fox jumps over the lazy dog while the farmer watches quietly from",
    "Quantum tunnelling lets particles cross barriers that classical physics forbids, so",
]
NEW_TOKENS = 24
FP32 = dict(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)


@bounded_engine_cache(maxsize=3)
def engine(method: str | None, **kw) -> LLM:
    """One LLM per configuration for the module (loading costs seconds); method None: no
    speculation."""
    options = dict(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
                   check_invariants=True)
    options.update(kw)
    return LLM(speculative_config=SPECS[method] if method else None, **options)


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate_both(params, prompts=PROMPTS, method="ngram", **kw):
    plain = engine(None, **kw).generate(prompts, params, use_tqdm=False)
    spec = engine(method, **kw).generate(prompts, params, use_tqdm=False)
    return plain, spec


def assert_same_completions(plain, spec) -> None:
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert y.token_ids == x.token_ids, b.prompt
            assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason,
                                                                  x.stop_reason)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("kw", [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 40},          # chunked prompts, drafts cut to the budget
    {"kv_cache_memory_bytes": 14 * BLOCK_BYTES, "max_num_batched_tokens": 64},  # preempts
], ids=["default", "no-prefix-caching", "chunked", "preempting"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain_decoding(kw, method):
    plain, spec = generate_both(greedy(), method=method, **kw)
    assert_same_completions(plain, spec)
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    assert 0 < accepted <= drafted
    assert spec[0].metrics.num_accepted_tokens > 0        # the rewrite prompt repeats its input
    assert all(o.metrics.num_draft_tokens == 0 for o in plain)
    llm = engine(method, **kw)
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    if "kv_cache_memory_bytes" in kw:
        assert stats.num_preemptions > 0, "the KV budget must force preemption"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_mixed_batch_of_speculating_and_plain_rows_and_n_greater_than_one(method):
    """Rows with a penalty or logprobs speculate beside plain ones (their controls replayed at
    every position); both greedy samples of an n = 2 request speculate on their own."""
    params = [greedy(), greedy(presence_penalty=0.5), greedy(logprobs=2), greedy(n=2)]
    plain, spec = generate_both(params, [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0]],
                                method)
    assert_same_completions(plain, spec)
    assert_same_logprobs(plain[2], spec[2])
    assert spec[0].metrics.num_accepted_tokens > 0 and spec[3].metrics.num_accepted_tokens > 0
    assert [len(c.token_ids) for c in spec[3].outputs] == [NEW_TOKENS] * 2


def assert_same_logprobs(plain, spec) -> None:
    """Each emitted token's logprobs equal plain decoding's: the same token ids, values
    within fp32 rounding (a verified position's logits come from a multi-token chunk)."""
    for x, y in zip(plain.outputs, spec.outputs, strict=True):
        assert len(y.logprobs) == len(y.token_ids) == len(x.logprobs)
        for a, b, token in zip(x.logprobs, y.logprobs, y.token_ids, strict=True):
            assert a.token_id == b.token_id == token
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in b.top] == [t for t, _ in a.top]
            assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_verifying_steps_take_the_decode_stack_with_the_per_op_results(dtype, monkeypatch):
    """A step of rows verifying drafts (1 + k tokens each over a cached context, beside
    plain decodes) runs as one C++ call (engine/cpu_decode_stack.py) with the per-op
    forward's results (enforce_eager=True), tokens and logprobs bit for bit: fp32 weights,
    and the GGUF's kept quantized ("auto": fp32 rows on AVX2 CPUs, bf16 on AVX512-BF16
    ones)."""
    from pagedllm.engine.cpu_decode_stack import CpuDecodeStack
    counts = counting_stack_steps(monkeypatch)
    options = dict(dtype=dtype, kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
                   speculative_config=NGRAM)
    params = [greedy(logprobs=2), greedy(), greedy(presence_penalty=0.5), greedy(n=2)]
    stacked = LLM(**options)
    rows = stacked.engine.model_runner.dtype
    if not CpuDecodeStack.runs_here(rows):
        stacked.shutdown()
        pytest.skip(f"the decode stack does not run {rows} rows on this CPU")
    ours = stacked.generate(PROMPTS, params, use_tqdm=False)
    stacked.shutdown()
    verifying = counts["several"]
    assert 0 < verifying < counts["stack"], counts  # verifying steps and plain decodes
    per_op = LLM(enforce_eager=True, **options).generate(PROMPTS, params, use_tqdm=False)
    assert counts["several"] == verifying
    assert sum(o.metrics.num_accepted_tokens for o in ours) > 0
    for a, b in zip(ours, per_op):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert x.logprobs == y.logprobs
        assert a.metrics.num_accepted_tokens == b.metrics.num_accepted_tokens


# Token controls whose effect depends on the output so far: each verified position must
# see the drafts before it as sampled (penalty counts, min_tokens' EOS ban, bad words one
# token from complete), or the accepted tokens differ from plain decoding's.
CONTROLS = {
    "repetition": dict(repetition_penalty=1.05),
    "frequency+presence": dict(frequency_penalty=0.7, presence_penalty=0.4),
    "logit_bias": dict(logit_bias={13: 4.0, 198: -3.0}),
    "allowed": dict(allowed_token_ids=list(range(20, 4000))),
    "min_tokens": dict(min_tokens=NEW_TOKENS - 2, ignore_eos=False),
    "logprobs": dict(logprobs=3),
    "everything": dict(repetition_penalty=1.1, frequency_penalty=0.3, logprobs=1,
                       logit_bias={28: -2.0}, min_tokens=4),
}


@pytest.mark.parametrize("controls", CONTROLS.values(), ids=CONTROLS.keys())
def test_speculation_replays_token_controls_at_every_verified_position(controls):
    controls = dict(controls)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                            ignore_eos=controls.pop("ignore_eos", True), **controls)
    plain, spec = generate_both(params)
    assert_same_completions(plain, spec)
    if params.logprobs is not None:
        for a, b in zip(plain, spec):
            assert_same_logprobs(a, b)
    # accepted drafts: positions past the first were replayed and checked
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0, "no draft was accepted"
    assert_all_blocks_free(engine("ngram"))


def test_bad_words_are_banned_inside_accepted_drafts():
    """A bad word that plain decoding would have produced, made of two tokens: the verified
    position after its first token bans the second, as plain decoding's step does."""
    base = engine(None).generate(PROMPTS[:1], greedy(), use_tqdm=False)[0].outputs[0]
    tokens = base.token_ids
    word = engine(None).get_tokenizer().decode(tokens[10:12])
    params = greedy(bad_words=[word])
    plain, spec = generate_both(params, PROMPTS[:1])
    assert_same_completions(plain, spec)
    assert plain[0].outputs[0].token_ids[:12] != tokens[:12]  # the ban changed the output
    assert spec[0].metrics.num_accepted_tokens > 0


EXTRACT = ("Record: name Ada Lovelace, born 1815 in London, occupation mathematician; "
           "name Alan Turing, born 1912 in London, occupation mathematician.\n"
           "The same records as JSON lines, one object per record:\n"
           '{"name": "Ada Lovelace", "born": 1815, "city": "London"}\n{"name": "')
PEOPLE = {"type": "object", "properties": {
    "people": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                         "city": {"type": "string", "enum": ["London", "Paris"]}},
        "required": ["name", "born", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}


@pytest.mark.parametrize("constraint", [
    {"json": PEOPLE},
    {"regex": r"(Ada Lovelace|Alan Turing), born [0-9]{4}( in London)?\."},
], ids=["json-schema", "regex"])
def test_grammar_rows_speculate_and_equal_plain_decoding(constraint):
    """A constrained row verifies drafts under its grammar's mask at every position: the
    same tokens as plain decoding, output that parses, and drafts the grammar refuses are
    rejected (never consumed by the matcher)."""
    params = SamplingParams(temperature=0, max_tokens=80, logprobs=1,
                            structured_outputs=StructuredOutputsParams(**constraint))
    prompts = [EXTRACT, EXTRACT + "Alan Turing", PROMPTS[1]]
    plain, spec = generate_both(params, prompts)
    assert_same_completions(plain, spec)
    for a, b in zip(plain, spec):
        assert_same_logprobs(a, b)
        if b.outputs[0].finish_reason == "stop" and "json" in constraint:
            assert len(json.loads(b.outputs[0].text)["people"]) == 2
    assert spec[0].metrics.num_accepted_tokens > 0   # the records are copied from the prompt
    assert_all_blocks_free(engine("ngram"))


def test_stop_strings_drop_the_logprobs_of_the_tokens_they_cut():
    base = engine(None).generate(PROMPTS[:1], greedy(40), use_tqdm=False)[0].outputs[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 5]
    plain, spec = generate_both(greedy(40, stop=[stop], logprobs=0), PROMPTS[:1])
    assert_same_completions(plain, spec)
    assert_same_logprobs(plain[0], spec[0])
    assert spec[0].metrics.num_accepted_tokens > 0


def test_stops_inside_an_accepted_run_land_where_plain_decoding_puts_them():
    prompt = PROMPTS[:1]
    base = engine(None).generate(prompt, greedy(40), use_tqdm=False)[0].outputs[0]
    tokens, text = base.token_ids, base.text
    cases = [
        greedy(40, stop_token_ids=[tokens[17]]),
        greedy(40, stop=[text[len(text) // 2:len(text) // 2 + 5]]),
        greedy(40, stop=[text[len(text) // 3:len(text) // 3 + 4]], include_stop_str_in_output=True),
        greedy(13),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=[tokens[5]]),
    ]
    for params in cases:
        plain, spec = generate_both(params, prompt)
        assert_same_completions(plain, spec)
        assert spec[0].outputs[0].finish_reason in ("stop", "length")
        assert spec[0].metrics.num_accepted_tokens > 0   # drafts were verified before it stopped
    assert_all_blocks_free(engine("ngram"))


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=NEW_TOKENS,
                            ignore_eos=True)
    llm = engine("ngram")
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    second = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert sum(o.metrics.num_draft_tokens for o in first) > 0
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in first)


def test_suffix_decoding_drafts_a_repeated_answer_from_earlier_outputs():
    """The same free-text prompt twice, one request after the other: the second one's
    answer is drafted from the first one's output in the global cache (and equals plain
    decoding); with the global cache off the second request gains nothing from the first."""
    prompt, params = [PROMPTS[2]], greedy(40)
    plain = engine(None).generate(prompt, params, use_tqdm=False)[0]
    for cached, llm in ((True, LLM(speculative_config=SUFFIX, **FP32)),
                        (False, LLM(speculative_config={
                            **SUFFIX, "suffix_decoding_max_cached_requests": 0}, **FP32))):
        first = llm.generate(prompt, params, use_tqdm=False)[0]
        second = llm.generate(prompt, params, use_tqdm=False)[0]
        assert_same_completions([plain, plain], [first, second])
        if cached:
            assert second.metrics.num_accepted_tokens >= 20
            assert second.metrics.num_accepted_tokens > 2 * first.metrics.num_accepted_tokens
        else:
            assert second.metrics.num_accepted_tokens == first.metrics.num_accepted_tokens
