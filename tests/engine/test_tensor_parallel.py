"""Tensor parallelism over torch.distributed (gloo): greedy tokens identical to one rank,
real worker processes that all go away, and a dead worker failing the engine loudly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.fault_injection import FaultInjector
from pagedllm.engine.tp.processes import sigint_deferred
from tiny_models import make_qwen3_dir  # tests/ (pytest prepends the rootdir)

PROMPTS = ["Hello, my name is", "The quick brown fox", "def add(a, b):", "你好，世界",
           "Once upon a time, in a small village by the sea,"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_qwen3_dir(tmp_path_factory.mktemp("tp-qwen3-kv2"), num_kv_heads=2)


def generate_ids(model: str, tp: int, prompts: list[str] = PROMPTS, **kw
                 ) -> tuple[list[list[int]], list[int]]:
    """Greedy token ids of the prompts, and the worker pids the engine had."""
    with LLM(model, dtype="float32", kv_cache_memory_bytes=16 * 2**20,
             tensor_parallel_size=tp, check_invariants=True, **kw) as llm:
        workers = llm.engine.model_runner.workers
        pids = workers.pids if workers is not None else []
        assert len(pids) == tp - 1
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], pids


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Every pid has exited (zombies are reaped by their parent; count them as gone)."""
    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left behind: {alive}")


def children() -> set[int]:
    """This process's live child processes but multiprocessing's resource tracker. Other
    tests' servers (the session-scoped one of tests/entrypoints) may be among them, so the tests
    compare this set before and after, never against an empty set."""
    pids = set()
    for c in psutil.Process().children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline()):
                pids.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.fixture(scope="module")
def qwen3_tp1(qwen3_dir) -> list[list[int]]:
    return generate_ids(str(qwen3_dir), 1)[0]


def test_tp2_qwen3_greedy_equals_tp1(qwen3_dir, qwen3_tp1):
    before = children()
    got, pids = generate_ids(str(qwen3_dir), 2)
    assert got == qwen3_tp1
    assert_gone(pids, timeout=0.5)   # shutdown() joined them
    assert children() <= before


@pytest.mark.slow
def test_tp2_with_replicated_kv_head_equals_tp1(tmp_path):
    """One KV head, two ranks: both ranks hold a copy of it."""
    model = str(make_qwen3_dir(tmp_path, num_kv_heads=1))
    ref, _ = generate_ids(model, 1)
    got, pids = generate_ids(model, 2, enable_prefix_caching=False)
    assert got == ref
    assert_gone(pids, timeout=0.5)


@pytest.mark.slow
def test_tp3_smollm2_greedy_equals_tp1(gguf_path):
    """The bundled SmolLM2: 9 heads, 3 KV heads, vocabulary 49152, split over 3 ranks."""
    prompts = PROMPTS[2:]  # 30 layers over 3 processes on 2 cores: keep it short
    ref, _ = generate_ids(str(gguf_path), 1, prompts)
    got, pids = generate_ids(str(gguf_path), 3, prompts)
    assert got == ref
    assert_gone(pids, timeout=0.5)


TORCHRUN_SCRIPT = """
import json, os, sys
from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=16 * 2**20,
              tensor_parallel_size=2, check_invariants=True)
    assert os.environ["RANK"] == "0"   # the other rank never returns from LLM(...)
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(**json.loads(sys.argv[3])),
                        use_tqdm=False)
    print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
"""


@pytest.mark.slow
def test_ranks_started_by_hand_with_torchrun_variables_equal_tp1(tmp_path, qwen3_dir, qwen3_tp1):
    """RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set per process, as on two machines."""
    from pagedllm.distributed import free_port
    script = tmp_path / "ranked.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    sp = {"temperature": 0, "max_tokens": GREEDY.max_tokens, "ignore_eos": True}
    args = [sys.executable, str(script), str(qwen3_dir), json.dumps(PROMPTS), json.dumps(sp)]
    base = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOGGING_LEVEL": "WARNING",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen(args, env={**base, "RANK": str(r), "LOCAL_RANK": "0",
                                         "LOCAL_WORLD_SIZE": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (1, 0)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    line = next(l for l in outs[1].splitlines() if l.startswith("TOKENS"))
    assert json.loads(line.removeprefix("TOKENS")) == qwen3_tp1
    assert "TOKENS" not in outs[0]


def test_tp_size_that_does_not_divide_the_heads_is_rejected(gguf_path):
    before = children()
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible"):
        LLM(str(gguf_path), tensor_parallel_size=2)
    assert children() <= before


@pytest.mark.slow
def test_failed_forward_pass_stops_the_tp_engine_but_a_failed_sampler_does_not(qwen3_dir):
    """At one rank a failing batch ends only its requests; with N ranks a forward pass that
    raises half way leaves the others inside a collective, so the engine stops instead."""
    with LLM(str(qwen3_dir), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
             tensor_parallel_size=2) as llm:
        pids = llm.engine.model_runner.workers.pids
        llm.engine.set_fault_injector(FaultInjector.parse("sampler@1"))
        out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error"
        llm.engine.set_fault_injector(FaultInjector.parse("model@1"))
        with pytest.raises(EngineDeadError, match="tensor-parallel step failed"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_gone(pids)


# ---- real processes: exits, signals, dead workers -----------------------------------------

SCRIPT = """
import os, signal, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import EngineDeadError

if __name__ == "__main__":
    # as a terminal's foreground job: a background job of a script (`pytest &`, as CI may
    # run) inherits SIGINT ignored, and Ctrl-C would never reach this one
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode = sys.argv[2]
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=16 * 2**20,
              tensor_parallel_size=2, distributed_timeout_seconds=float(sys.argv[3]))
    engine = llm.engine
    worker = engine.model_runner.workers.procs[0]
    print("PIDS", os.getpid(), worker.pid, flush=True)
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), "Once upon a time " * (i + 1), sp)
    for _ in range(3):
        engine.step()
    print("STEPPING", flush=True)
    if mode in ("kill", "stop"):
        os.kill(worker.pid, signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    t = time.monotonic()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            if mode == "forever" and time.monotonic() - t < 60 and not engine.has_unfinished_requests():
                for i in range(4):  # more work, until interrupted (at most a minute)
                    engine.add_request(f"{time.monotonic()}-{i}", "Once upon a time", sp)
    except EngineDeadError as e:
        print(f"ERROR after {time.monotonic() - t:.1f}s: {e}", flush=True)
        sys.exit(3)
    print("FINISHED", flush=True)
"""


def run_script(tmp_path: Path, model: Path, mode: str, timeout_s: float = 300.0,
               on_stepping=None, wait_s: float = 120) -> tuple[int, str, list[int]]:
    """Run SCRIPT in its own session; return its exit code, output and [rank0, worker] pids."""
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, str(script), str(model), mode, str(timeout_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines: list[str] = []
    pids: list[int] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("PIDS"):
                pids = [int(x) for x in line.split()[1:]]
            if line.startswith("STEPPING") and on_stepping is not None:
                on_stepping(proc)
        code = proc.wait(timeout=wait_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, "".join(lines), pids


@pytest.mark.slow
def test_worker_killed_mid_run_fails_the_engine_with_a_clear_error(tmp_path, qwen3_dir):
    code, out, pids = run_script(tmp_path, qwen3_dir, "kill")
    assert code == 3, out
    assert "tensor-parallel worker died: rank 1" in out or "worker died: rank 1" in out, out
    assert "exited with code -9" in out, out
    assert_gone(pids)


@pytest.mark.slow
def test_hung_worker_times_out_instead_of_hanging(tmp_path, qwen3_dir):
    code, out, pids = run_script(tmp_path, qwen3_dir, "stop", timeout_s=5.0)
    assert code == 3, out
    assert "tensor-parallel step failed, the engine cannot continue" in out, out
    assert_gone(pids)


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path, qwen3_dir):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it."""
    code, out, pids = run_script(  # the script steps until interrupted: no race with its end
        tmp_path, qwen3_dir, "forever",
        on_stepping=lambda proc: (time.sleep(0.5), os.killpg(proc.pid, signal.SIGINT)))
    assert "KeyboardInterrupt" in out and "FINISHED" not in out, out
    assert code != 0
    assert_gone(pids)


@pytest.mark.parametrize("handler", [signal.default_int_handler, signal.SIG_IGN],
                         ids=["default", "ignored"])
def test_ctrl_c_inside_a_step_waits_for_its_end_and_an_ignored_one_stays_ignored(handler):
    previous = signal.signal(signal.SIGINT, handler)
    finished = False
    try:
        with pytest.raises(KeyboardInterrupt) if handler is not signal.SIG_IGN else nullcontext():
            with sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here, between bytecodes
                finished = True
        assert finished
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_normal_exit_without_shutdown_leaves_no_process(tmp_path, qwen3_dir):
    code, out, pids = run_script(tmp_path, qwen3_dir, "run")
    assert code == 0 and "FINISHED" in out, out
    assert_gone(pids)


@pytest.mark.slow
def test_rank0_killed_takes_its_workers_along(tmp_path, qwen3_dir):
    code, out, pids = run_script(
        tmp_path, qwen3_dir, "run",
        on_stepping=lambda proc: os.kill(proc.pid, signal.SIGKILL))
    assert code == -signal.SIGKILL, out
    assert_gone(pids)


# ---- chunked prefill, n > 1, beam search, swap: TP=2 equals TP=1 ----------------------------

BLOCK_BYTES = 2 * 3 * 16 * 2 * 32 * 4    # the kv2 Qwen3, fp32, block_size 16, all ranks
LONG_PROMPT = [(i * 37) % 4000 + 100 for i in range(150)]   # 5 chunks of 32 tokens


@pytest.fixture(scope="module")
def small_engines(qwen3_dir):
    """TP=1 and TP=2 engines with a 32-token step budget (chunked prefill), 16 KV blocks
    and swap preemption, shared by the tests below (one start-up each). Every test runs the
    same requests on both, so their scheduler states stay the same. These tests come last in
    the module: a process holds one TP engine at a time (one default process group), and
    this one lives until the module ends."""
    kw = dict(dtype="float32", block_size=16, max_model_len=256, max_num_batched_tokens=32,
              kv_cache_memory_bytes=16 * BLOCK_BYTES, preemption_mode="swap",
              swap_space=0.002, check_invariants=True)
    before = children()
    with LLM(str(qwen3_dir), **kw) as tp1, LLM(str(qwen3_dir), tensor_parallel_size=2, **kw) as tp2:
        assert tp2.engine.scheduler.block_manager.num_blocks == 16
        assert tp2.engine.model_runner.num_swap_blocks == tp1.engine.model_runner.num_swap_blocks
        pids = tp2.engine.model_runner.workers.pids
        yield {1: tp1, 2: tp2}
    assert_gone(pids, timeout=0.5)
    assert children() <= before


def run_both(engines, fn) -> dict[int, list]:
    return {tp: fn(llm) for tp, llm in engines.items()}


@pytest.mark.slow
def test_tp2_chunked_prefill_of_a_long_prompt_equals_tp1(small_engines):
    prompts = [LONG_PROMPT, PROMPTS[0], PROMPTS[3]]   # decodes mix with the long prompt's chunks
    chunks, mixed = {}, {}

    def go(llm):
        engine = llm.engine
        steps = num_mixed = 0
        for i, p in enumerate(prompts):
            engine.add_request(f"chunked-{i}", p, GREEDY)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
            last = engine.last_step
            steps += last.num_prefill_tokens > 0
            num_mixed += 0 < last.num_prefill_tokens < last.num_tokens   # decodes + a chunk
        chunks[engine.model_runner.world_size] = steps
        mixed[engine.model_runner.world_size] = num_mixed
        return [outs[f"chunked-{i}"] for i in range(len(prompts))]

    got = run_both(small_engines, go)
    assert got[2] == got[1]
    assert chunks[2] == chunks[1] >= len(LONG_PROMPT) // 32
    assert mixed[2] == mixed[1] > 0


@pytest.mark.slow
def test_tp2_parallel_sampling_n2_seeded_equals_tp1(small_engines):
    sp = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    cows = {}

    def go(llm):
        bm = llm.engine.scheduler.block_manager
        before = bm.num_copy_on_writes
        outs = llm.generate(PROMPTS[:3], sp, use_tqdm=False)
        cows[llm.engine.model_runner.world_size] = bm.num_copy_on_writes - before
        return [[c.token_ids for c in o.outputs] for o in outs]

    got = run_both(small_engines, go)
    assert got[2] == got[1]
    assert all(a != b for a, b in got[2])        # two different samples per prompt
    assert cows[2] == cows[1] > 0                # forks shared, then copied, their last block


@pytest.mark.slow
def test_tp2_beam_search_equals_tp1(small_engines):
    def go(llm):
        outs = llm.beam_search(PROMPTS[:2], beam_width=2, max_tokens=12, use_tqdm=False)
        return [([c.token_ids for c in o.outputs], o.extra["beam_scores"]) for o in outs]

    got = run_both(small_engines, go)
    for (ids2, scores2), (ids1, scores1) in zip(got[2], got[1]):
        assert ids2 == ids1
        assert scores2 == pytest.approx(scores1, abs=1e-4)   # fp32 sums in another order


@pytest.mark.slow
def test_tp2_swap_preemption_under_a_tiny_kv_cache_equals_tp1(small_engines):
    """5 sequences of 3-4 blocks in 16 blocks: some are swapped out and back in. Each rank
    swaps its own KV shard to its own memory-mapped file."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] * 2 for i in range(5)]
    swaps = {}

    def go(llm):
        sched = llm.engine.scheduler
        before = sched.num_swap_outs
        outs = llm.generate(prompts, sp, use_tqdm=False)
        swaps[llm.engine.model_runner.world_size] = sched.num_swap_outs - before
        assert sched.swap_pool.num_free_blocks == sched.swap_pool.num_blocks
        return [o.token_ids for o in outs]

    got = run_both(small_engines, go)
    assert got[2] == got[1]
    assert swaps[2] == swaps[1] > 0
    worker = small_engines[2].engine.model_runner.workers.pids[0]
    assert "pagedllm-swap-" in Path(f"/proc/{worker}/maps").read_text()
