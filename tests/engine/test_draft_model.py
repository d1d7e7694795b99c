"""Speculative decoding with a draft model (a separate model, or the target's first layers)
in the engine: greedy outputs equal plain decoding token for token (fp32, bundled model)
under prefix caching, chunked prefill, preemption by recompute and swap, mixed batches and
n > 1; the target as its own draft has every draft accepted; sampled outputs keep the
target's distribution with a draft unlike the target (chi-square on a tiny model); the
draft's blocks are all free once requests finish or are aborted."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from engine_cache import bounded_engine_cache  # tests/ (pytest prepends the rootdir)
from pagedllm import LLM, SamplingParams
from pagedllm.loader import default_model_path
import tiny_models
from tiny_models import TINY, write_tiny_llama_gguf

BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4   # one 16-token block of SmolLM2's fp32 KV
PROMPTS = [
    "Rewrite this function, renaming values to items:\ndef total(values):\n"
    "    result = 0\n    for value in values:\n        result += value\n    return result\n"
    "\nRewritten:\n",
    "Copy the list exactly: red, green, blue, red, green, blue, red, green, blue. Copy:",
    "The quick brown fox jumps over the lazy dog while the farmer watches quietly from",
    "Quantum tunnelling lets particles cross barriers that classical physics forbids, so",
]
NEW_TOKENS = 20
SELF = {"method": "self", "num_draft_layers": 8, "num_speculative_tokens": 3}
ITSELF = {"model": str(default_model_path()), "num_speculative_tokens": 4}   # the target as draft
SETTINGS = [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 40},                                   # chunked prompts
    {"kv_cache_memory_bytes": 10 * BLOCK_BYTES, "max_num_batched_tokens": 64},  # recompute
    {"kv_cache_memory_bytes": 10 * BLOCK_BYTES, "max_num_batched_tokens": 64,
     "preemption_mode": "swap", "swap_space": 0.05},
]
# (accepting every draft, rows finish in fewer steps: a tighter budget forces preemption)
TIGHT = [{**kw, "kv_cache_memory_bytes": 7 * BLOCK_BYTES} for kw in SETTINGS[3:]]
SETTING_IDS = ["default", "no-prefix-caching", "chunked", "preempt-recompute", "preempt-swap"]


def _freeze(value):
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


@bounded_engine_cache(maxsize=3)
def _engine(spec: tuple | None, model: str | None, kw: tuple) -> LLM:
    options = dict(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
                   check_invariants=True)
    options.update(dict(kw))
    return LLM(model, speculative_config=dict(spec) if spec else None, **options)


def engine(spec: dict | None = None, model: str | None = None, **kw) -> LLM:
    """One LLM per configuration for the module (loading costs seconds)."""
    return _engine(_freeze(spec), model, _freeze(kw))


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def drafted(outputs) -> tuple[int, int]:
    return (sum(o.metrics.num_draft_tokens for o in outputs),
            sum(o.metrics.num_accepted_tokens for o in outputs))


def assert_all_free(llm: LLM) -> None:
    """The target's blocks and the draft's: every one free."""
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    proposer = llm.engine.scheduler.proposer
    assert proposer.num_free_blocks == proposer.num_blocks and not proposer.states
    assert sorted(proposer.free_blocks) == list(range(proposer.num_blocks))


@pytest.mark.parametrize("kw", SETTINGS, ids=SETTING_IDS)
def test_self_speculation_equals_plain_decoding(kw):
    plain = engine(None, **kw).generate(PROMPTS, greedy(), use_tqdm=False)
    llm = engine(SELF, **kw)
    spec = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    num_drafted, num_accepted = drafted(spec)
    assert num_drafted > 0 and 0 <= num_accepted <= num_drafted
    if "kv_cache_memory_bytes" in kw:
        assert llm.engine.stats().num_preemptions > 0, "the KV budget must force preemption"
    assert_all_free(llm)


@pytest.mark.parametrize("kw", [SETTINGS[0], SETTINGS[2], *TIGHT],
                         ids=["default", "chunked", "preempt-recompute", "preempt-swap"])
def test_the_target_as_its_own_draft_has_every_draft_accepted(kw):
    """The draft computes what the target computes: a draft it rejects would be a token the
    catch-up (accepted drafts, the target's token, recomputed prompts) got wrong."""
    plain = engine(None, **kw).generate(PROMPTS, greedy(), use_tqdm=False)
    llm = engine(ITSELF, **kw)
    spec = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    num_drafted, num_accepted = drafted(spec)
    assert num_drafted > NEW_TOKENS and num_accepted == num_drafted
    if "kv_cache_memory_bytes" in kw:
        assert llm.engine.stats().num_preemptions > 0, "the KV budget must force preemption"
    assert_all_free(llm)


def test_mixed_batch_of_drafting_and_plain_rows_and_n_greater_than_one():
    params = [greedy(), greedy(presence_penalty=0.5), greedy(logprobs=2), greedy(n=2)]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0]]
    plain = engine(None).generate(prompts, params, use_tqdm=False)
    llm = engine(ITSELF)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    # (rows with penalties or logprobs speculate too: their controls are replayed per position)
    for out in spec:
        assert out.metrics.num_accepted_tokens == out.metrics.num_draft_tokens > 0
    assert_all_free(llm)


def test_a_short_draft_pool_proposes_less_and_changes_nothing():
    """Four draft blocks (64 tokens) for four rows (45, 25, 15 and 15 prompt tokens): rows
    wait for blocks or draft fewer tokens. One block (16 tokens) never holds a 25-token
    prompt: that request drafts nothing at all."""
    plain = engine(None).generate(PROMPTS, greedy(), use_tqdm=False)
    unlimited = engine(ITSELF).generate(PROMPTS, greedy(), use_tqdm=False)
    for num_blocks in (4, 1):
        llm = engine({**ITSELF, "num_draft_blocks": num_blocks})
        assert llm.engine.scheduler.proposer.num_blocks == num_blocks
        spec = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert token_ids(spec) == token_ids(plain)
        assert drafted(spec)[0] < drafted(unlimited)[0]
        assert_all_free(llm)
    alone = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)
    assert token_ids(alone) == token_ids(plain[1:2]) and drafted(alone) == (0, 0)


def test_draft_blocks_are_freed_when_requests_are_aborted():
    llm = engine(SELF)
    eng = llm.engine
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"abort-{i}", prompt, greedy(200))
    for _ in range(4):
        eng.step()
    proposer = eng.scheduler.proposer
    assert proposer.states and proposer.num_free_blocks < proposer.num_blocks
    for i in range(len(PROMPTS)):
        eng.abort_request(f"abort-{i}")
    assert not eng.has_unfinished_requests()
    assert_all_free(llm)


# ---- tiny models: vocabularies, sampling -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny Llamas with the same tokenizer: the target, and a draft whose weights are
    the target's plus 10% noise (unlike it: its greedy drafts are accepted about 25% of
    the time)."""
    root = tmp_path_factory.mktemp("draft")
    target = write_tiny_llama_gguf(root / "target.gguf", seed=0)
    base, noise = tiny_models.tiny_weights(0), tiny_models.tiny_weights(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "tiny_weights",
                   lambda seed=0: {k: v + 0.1 * (noise[k] - noise[k].mean())
                                  for k, v in base.items()})
        draft = write_tiny_llama_gguf(root / "draft.gguf")
    return target, draft


def test_a_draft_with_another_vocabulary_is_refused(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="different vocabulary.*token ids against"):
        LLM(None, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 * 2**20,
            speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    tokens, types, merges = tiny_models.tiny_vocab()
    renamed = tokens[:4] + [tokens[5], tokens[4]] + tokens[6:]   # two ids swap their tokens
    monkeypatch.setattr(tiny_models, "tiny_vocab", lambda: (renamed, types, merges))
    other = tiny_models.write_tiny_llama_gguf(draft.parent / "renamed.gguf", seed=1)
    with pytest.raises(ValueError, match="different vocabulary.*pairs differ"):
        LLM(str(target), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
            speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_self_speculation_needs_fewer_layers_than_the_target(tiny_pair):
    with pytest.raises(ValueError, match=r"num_draft_layers must be in \[1, 1\]"):
        LLM(str(tiny_pair[0]), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
            speculative_config={"method": "self", "num_draft_layers": TINY["layers"],
                                "num_speculative_tokens": 2})


def _tiny_engine(target: Path, spec: dict | None) -> LLM:
    return LLM(str(target), dtype="float32", kv_cache_memory_bytes=32 * 2**20,
               max_num_seqs=256, speculative_config=spec, check_invariants=True)


def test_sampling_with_a_draft_is_reproducible_and_keeps_the_target_distribution(tiny_pair):
    """Tokens sampled at temperature 1.3 from the top 3, many seeds, through the engine
    with a draft unlike the target (k = 2: tokens 2 and 3 are two drafts verified at once,
    or corrections): the joint frequencies of the first three tokens' 27 outcomes match the
    target's exact probabilities, worked out from plain greedy runs' top-3 logprobs."""
    target, draft = tiny_pair
    temperature, prompt = 1.3, "ab cd"
    plain = _tiny_engine(target, None)
    probs = _exact_joint_probabilities(plain, prompt, temperature)
    # (every row drafts 2 tokens every step: no stand-down in the 256-row batch, no
    # adaptive shrinking of a draft that is often rejected)
    llm = _tiny_engine(target, {"model": str(draft), "num_speculative_tokens": 2,
                                "adaptive": False, "disable_by_batch_size": None})
    draws = 3000
    params = [SamplingParams(temperature=temperature, top_k=3, seed=s, max_tokens=4,
                             ignore_eos=True) for s in range(draws)]
    outputs = llm.generate([prompt] * draws, params, use_tqdm=False)
    again = llm.generate([prompt] * 50, params[:50], use_tqdm=False)
    assert token_ids(again) == token_ids(outputs[:50])
    num_drafted, num_accepted = drafted(outputs)
    assert num_drafted >= 2 * draws and 0 < num_accepted < num_drafted
    counts = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outputs)
    assert set(counts) <= set(probs)
    outcomes = sorted(probs)
    observed = [counts.get(o, 0) for o in outcomes]
    expected = [probs[o] * draws for o in outcomes]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    p_value = float(torch.special.gammaincc(torch.tensor((len(outcomes) - 1) / 2),
                                            torch.tensor(chi2 / 2)))   # chi-square's tail
    assert p_value > 1e-3, (chi2, observed, expected)
    assert_all_free(llm)


def _exact_joint_probabilities(llm: LLM, prompt: str, temperature: float
                               ) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of sampling at temperature from the top 3 of each step's logits: the
    top-3 logprobs of each prefix (plain greedy runs, one token, logprobs=3) differ from the
    logits by a constant, which the renormalisation over the top 3 cancels."""
    prompt_ids = llm.engine.tokenizer.encode(prompt)

    def top3(prefixes: list[tuple[int, ...]]) -> dict[tuple[int, ...], dict[int, float]]:
        outs = llm.generate([prompt_ids + list(p) for p in prefixes],
                            SamplingParams(temperature=0, max_tokens=1, logprobs=3,
                                           ignore_eos=True), use_tqdm=False)
        dists = {}
        for p, out in zip(prefixes, outs):
            top = out.outputs[0].logprobs[0].top
            weights = {t: pow(2.718281828459045, lp / temperature) for t, lp in top[:3]}
            total = sum(weights.values())
            dists[p] = {t: w / total for t, w in weights.items()}
        return dists

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        dists = top3(list(joint))
        joint = {p + (t,): q * pt for p, q in joint.items() for t, pt in dists[p].items()}
    return joint


def test_draft_speculative_configs_parse():
    from pagedllm.config import parse_speculative_config
    assert parse_speculative_config({"model": "d.gguf", "num_speculative_tokens": 3}) == {
        "method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3,
        "num_draft_blocks": None, "adaptive": True, "disable_by_batch_size": 8}
    assert parse_speculative_config('{"method": "self", "num_draft_layers": 4, '
                                    '"num_speculative_tokens": 2, "num_draft_blocks": 9}') == {
        "method": "self", "num_draft_layers": 4, "num_speculative_tokens": 2,
        "num_draft_blocks": 9, "adaptive": True, "disable_by_batch_size": 8}
    for value, message in [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
        ({"method": "self", "num_speculative_tokens": 2}, "num_draft_layers must be"),
        ({"method": "self", "num_draft_layers": 2, "num_speculative_tokens": 2,
          "model": "x"}, "unknown keys"),
        ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "unknown keys"),
        ({"model": "x", "num_speculative_tokens": 2, "num_draft_blocks": 0}, "num_draft_blocks"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(value)


def test_the_self_draft_shares_the_targets_weights_and_has_its_own_kv_cache(tiny_pair):
    from pagedllm.layers.attention import Attention
    llm = _tiny_engine(tiny_pair[0], {"method": "self", "num_draft_layers": 1,
                                      "num_speculative_tokens": 2})
    target, proposer = llm.engine.model_runner, llm.engine.scheduler.proposer
    draft = proposer.runner.model
    assert len(draft.model.layers) == 1 and len(target.model.model.layers) == TINY["layers"]
    target_tensors = {p.data_ptr() for p in target.model.parameters()}
    assert {p.data_ptr() for p in draft.parameters()} <= target_tensors   # nothing copied
    target_attn = [m for m in target.model.modules() if isinstance(m, Attention)]
    draft_attn = [m for m in draft.modules() if isinstance(m, Attention)]
    assert len(draft_attn) == 1 and draft_attn[0] is not target_attn[0]
    assert draft_attn[0].k_cache.data_ptr() == proposer.runner.kv_cache[0, 0].data_ptr()
    assert target_attn[0].k_cache.data_ptr() == target.kv_cache[0, 0].data_ptr()
    assert proposer.num_blocks == target.num_kvcache_blocks     # the default pool size
    prompts = ["ab cd ef", "tt tt tt tt"]
    plain = _tiny_engine(tiny_pair[0], None).generate(prompts, greedy(30), use_tqdm=False)
    spec = llm.generate(prompts, greedy(30), use_tqdm=False)
    assert token_ids(spec) == token_ids(plain) and drafted(spec)[0] > 0
    assert_all_free(llm)
