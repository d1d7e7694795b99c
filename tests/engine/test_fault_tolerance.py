"""One failing batch ends its own requests and nothing else; broken accounting stops the engine.

Faults are injected with the test-only FaultInjector (engine/fault_injection.py): the model
forward pass raising half-way through its layers, the sampler, one request's detokenizer,
the engine core. After each, the blocks are all free and the same engine still answers
with HF transformers' greedy tokens.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, EngineConfig, SamplingParams
from pagedllm.config import env_flag
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.fault_injection import FaultInjector, FaultRule

NEW_TOKENS = 8
# Longer than two 16-token blocks, so full blocks enter the prefix cache during the prefill.
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every "
    "morning",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n",
    "The three primary colors are red, yellow and blue. When you mix red and yellow you get",
]
MARKER = "XYZZY"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 * 2**20,
               check_invariants=True)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.get_tokenizer().encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy_tokens, prompt_ids):
    return hf_greedy_tokens(prompt_ids, NEW_TOKENS)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.has_unfinished_requests() and not engine.requests


def assert_serves_hf_greedy(llm: LLM, prompt_ids, hf_greedy) -> None:
    outs = llm.generate(prompt_ids, greedy(), use_tqdm=False)
    for out, ref in zip(outs, hf_greedy):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == ref
    assert_nothing_held(llm)


@pytest.fixture
def inject(llm):
    """Install a fault injector for one test; always removed afterwards."""
    def install(spec: str) -> FaultInjector:
        faults = FaultInjector.parse(spec)
        llm.engine.set_fault_injector(faults)
        return faults
    yield install
    llm.engine.set_fault_injector(None)


# ----------------------------------------------------------------------------- batch faults

@pytest.mark.parametrize("spec, message", [
    ("model@1", "injected fault in model (call 1)"),      # the prefill, half-way through the layers
    ("sampler@1", "injected fault in sampler (call 1)"),
    ("model@4", "injected fault in model (call 4)"),      # the third decode step
])
@pytest.mark.slow
def test_failing_batch_ends_its_requests_and_engine_keeps_serving(llm, inject, prompt_ids, hf_greedy,
                                                                  spec, message):
    faults = inject(spec)
    outs = llm.generate(prompt_ids, greedy(), use_tqdm=False)
    assert faults.rules[0].fired == 1
    for out, ref in zip(outs, hf_greedy):
        assert out.finished and out.finish_reason == "error"
        assert out.error is not None and message in out.error
        # the tokens produced before the failing step are the right ones
        assert out.token_ids == ref[:len(out.token_ids)]
    assert_nothing_held(llm)
    llm.engine.set_fault_injector(None)
    # The failed prefill left half-written KV in blocks it had registered in the prefix
    # cache; serving the same prompts again must not reuse them.
    assert_serves_hf_greedy(llm, prompt_ids, hf_greedy)


@pytest.mark.slow
def test_detokenizer_fault_ends_that_request_alone(llm, inject, prompt_ids, hf_greedy):
    faults = inject("detokenizer@2")   # the second request of the prefill batch
    outs = llm.generate(prompt_ids, greedy(), use_tqdm=False)
    assert faults.rules[0].fired == 1
    failed = [out for out in outs if out.finish_reason == "error"]
    assert len(failed) == 1 and "injected fault in detokenizer" in failed[0].error
    for out, ref in zip(outs, hf_greedy):
        if out.finish_reason != "error":
            assert out.error is None and out.token_ids == ref
    assert_nothing_held(llm)
    llm.engine.set_fault_injector(None)
    assert_serves_hf_greedy(llm, prompt_ids, hf_greedy)


def test_fault_on_the_last_token_still_reports_an_error(llm, inject, prompt_ids):
    """The sequence already finished (length) in the step whose detokenization fails."""
    inject(f"detokenizer@{NEW_TOKENS}")
    out = llm.generate(prompt_ids[:1], greedy(), use_tqdm=False)[0]
    assert out.finish_reason == "error" and len(out.token_ids) == NEW_TOKENS
    assert "injected fault in detokenizer" in out.error
    assert_nothing_held(llm)


@pytest.mark.slow
def test_prompt_marker_rule_fails_only_the_marked_request(llm, inject, prompt_ids, hf_greedy):
    faults = inject(f"detokenizer@prompt~{MARKER}")
    marked = PROMPTS[0] + f" {MARKER}"
    outs = llm.generate([marked, *prompt_ids[1:]], greedy(), use_tqdm=False)
    assert outs[0].finish_reason == "error" and MARKER in outs[0].error
    assert faults.rules[0].fired == 1
    for out, ref in zip(outs[1:], hf_greedy[1:]):
        assert out.error is None and out.token_ids == ref
    assert_nothing_held(llm)


def test_faults_are_off_without_the_environment(llm, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_FAULT_INJECTION", raising=False)
    assert FaultInjector.from_env() is None
    assert llm.engine.faults is None and llm.engine.model_runner.faults is None
    assert not any(m._forward_pre_hooks for m in llm.engine.model_runner.model.modules())


def test_fault_spec_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FAULT_INJECTION", "sampler@3, model@prompt~boom")
    faults = FaultInjector.from_env()
    assert [(r.site, r.call, r.marker) for r in faults.rules] == [("sampler", 3, None),
                                                                  ("model", None, "boom")]
    for bad in ("sampler", "gpu@1", "model@0", "model@soon"):
        with pytest.raises(ValueError, match="fault-injection|PAGEDLLM_FAULT_INJECTION"):
            FaultInjector.parse(bad)
    with pytest.raises(ValueError, match="exactly one"):
        FaultRule("model")


# ----------------------------------------------------------------------------- invariants

def test_invariant_checking_is_on_in_tests_and_follows_the_environment(monkeypatch):
    assert EngineConfig().check_invariants is True          # tests/conftest.py sets it
    assert EngineConfig(check_invariants=False).check_invariants is False
    monkeypatch.setenv("PAGEDLLM_CHECK_INVARIANTS", "0")
    assert EngineConfig().check_invariants is False
    monkeypatch.setenv("PAGEDLLM_CHECK_INVARIANTS", "maybe")
    with pytest.raises(ValueError, match="PAGEDLLM_CHECK_INVARIANTS"):
        env_flag("PAGEDLLM_CHECK_INVARIANTS")


def _corrupt_ref_count(engine) -> str:
    seq = engine.scheduler.running[0]
    block_id = seq.block_table[0]
    engine.scheduler.block_manager.blocks[block_id].ref_count += 1
    return f"block {block_id}: ref_count 2 but 1 block tables hold it"


def _corrupt_free_list(engine) -> str:
    """A block in use is also put on the free list: the next allocation would hand it out twice."""
    seq = engine.scheduler.running[0]
    block_id = seq.block_table[-1]
    engine.scheduler.block_manager.free_block_ids[block_id] = None
    return f"block {block_id}: free=True used=True"


def _corrupt_cached_tokens(engine) -> str:
    """The prefix-cache entry of a full block claims other tokens than the block holds."""
    seq = engine.scheduler.running[0]
    block = engine.scheduler.block_manager.blocks[seq.block_table[0]]
    block.token_ids = [t + 1 for t in block.token_ids]
    return "holds other tokens than logical block 0"


def _drop_request_state(engine) -> str:
    request_id = engine.scheduler.running[0].request_id
    del engine.requests[request_id]
    return f"scheduled sequences without a request: [{request_id!r}]"


def tiny_llm(tiny_gguf) -> LLM:
    """An engine that stops in these tests: the tiny random model builds in milliseconds."""
    return LLM(str(tiny_gguf), dtype="float32", max_model_len=128, max_num_seqs=8,
               kv_cache_memory_bytes=2**20, check_invariants=True)


TINY_PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12] * 7, [13, 14] * 12]


@pytest.mark.parametrize("corrupt", [_corrupt_ref_count, _corrupt_free_list, _corrupt_cached_tokens,
                                     _drop_request_state])
def test_invariant_violation_stops_the_engine_with_a_precise_message(tiny_gguf, corrupt):
    llm = tiny_llm(tiny_gguf)
    engine = llm.engine
    for i, ids in enumerate(TINY_PROMPTS):
        engine.add_request(f"r{i}", ids, greedy())
    engine.step()                      # the prefill: every request now holds blocks
    expected = corrupt(engine)
    with pytest.raises(EngineDeadError, match="invariant violated after scheduling") as info:
        engine.step()
    assert expected in str(info.value)
    # Every request in flight gets a final error output naming the cause; none computed on.
    outs = info.value.outputs
    assert len(outs) == len(TINY_PROMPTS) - (corrupt is _drop_request_state)
    for out in outs:
        assert out.finished and out.finish_reason == "error" and expected in out.error
        assert len(out.token_ids) <= 1      # no step ran on the corrupt accounting
    assert not engine.has_unfinished_requests() and not engine.requests
    # It refuses further work instead of serving from corrupt accounting.
    with pytest.raises(EngineDeadError, match="engine stopped earlier"):
        llm.generate(TINY_PROMPTS[0], greedy(), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        engine.step()


def test_engine_core_fault_stops_the_engine(tiny_gguf):
    llm = tiny_llm(tiny_gguf)
    llm.engine.set_fault_injector(FaultInjector.parse("core@3"))
    with pytest.raises(EngineDeadError, match="injected fault in core") as info:
        llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False)
    assert len(info.value.outputs) == len(TINY_PROMPTS)
    assert all(out.finish_reason == "error" for out in info.value.outputs)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    with pytest.raises(EngineDeadError, match="engine stopped earlier"):
        llm.generate(TINY_PROMPTS[0], greedy(), use_tqdm=False)
