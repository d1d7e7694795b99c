"""The bench's CUDA options, checked on the CPU: --device, the HF subset, --eager-too, the
GPU measurements (their arithmetic, and the same code run on CPU tensors) and the
roofline built from them. tests at the end need a GPU and say so when skipped."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.bench import hardware
from pagedllm.bench import workloads as wl
from pagedllm.bench.hf_runner import left_padded
from pagedllm.bench.main import (add_bench_args, add_labels, add_roofline, bench_device,
                                 build_workloads, engine_kwargs, hf_subset, validate_args)
from pagedllm.bench.random_model import PRESETS, _MODEL_CLASSES, save_tokenizer
from pagedllm.bench.report import (format_comparisons, format_machine, format_table,
                                   relative_to, speedups_over_eager)
from pagedllm.bench.results import BenchResult
from pagedllm.bench.roofline import model_cost
from pagedllm.engine.cpu_decode_stack import CpuDecodeStack
from pagedllm.loader.hf_loader import config_from_hf

CUDA = torch.cuda.is_available()
GPU_THROUGHPUT = ["throughput", "--shape", "nanovllm", "--device", "cuda", "--dtype", "bfloat16",
                  "--compare", "hf", "--hf-num-prompts", "64", "--hf-batch-sizes", "64"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(conflict_handler="resolve")
    add_bench_args(p)
    return p.parse_args(argv)


def qwen3_06b_config():
    config_class, kwargs = PRESETS["qwen3-0.6b"]
    import transformers
    hf = getattr(transformers, config_class)(**kwargs).to_dict()
    hf["architectures"] = [_MODEL_CLASSES[config_class]]
    return config_from_hf(hf, "qwen3-0.6b")


def row(engine: str = "pagedllm", workload: str = "latency", **kw) -> BenchResult:
    base = dict(workload=workload, engine=engine, dtype="bfloat16", threads=16, versions={},
                settings={}, num_requests=1, prompt_tokens=128, requested_output_tokens=256,
                output_tokens=256, exact_output_lens=True, device="cuda")
    base.update(kw)
    return BenchResult(**base)


# ---- arguments ---------------------------------------------------------------------------

def test_the_gpu_command_parses_and_gives_the_engine_device_cuda():
    args = parse(GPU_THROUGHPUT)
    assert args.device == "cuda" and args.hf_num_prompts == 64 and args.hf_batch_sizes == [64]
    assert args.compare == ["hf"] and args.dtype == ["bfloat16"]
    assert engine_kwargs(args)["device"] == "cuda"
    assert bench_device(args) == "cuda"
    assert bench_device(parse(["latency", "--device", "cpu"])) == "cpu"
    assert bench_device(parse(["latency"])) == ("cuda" if CUDA else "cpu")  # auto, as the engine


def test_device_cuda_without_a_gpu_is_a_clear_error_and_with_one_validates():
    args = parse(GPU_THROUGHPUT)
    if CUDA:
        validate_args(args)
    else:
        with pytest.raises(ValueError, match="--device cuda but torch sees no CUDA device"):
            validate_args(args)


def test_nanovllm_shape_defaults_to_256_requests_as_nanovllm_does():
    args = parse(["throughput", "--shape", "nanovllm"])
    (w,) = build_workloads(args)
    assert w.name == "throughput-nanovllm" and len(w.requests) == 256
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in w.requests)
    (w1,) = build_workloads(parse(["throughput"]))
    assert len(w1.requests) == 64


@pytest.mark.parametrize("argv, message", [
    (["latency", "--eager-too", "--enforce-eager"], "drop --enforce-eager"),
    (["throughput", "--pagedllm-on-hf-subset"], "needs --hf-num-prompts"),
    (["throughput", "--hf-num-prompts", "0"], "--hf-num-prompts must be >= 1"),
])
def test_contradictory_gpu_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        validate_args(parse(argv + ["--device", "cpu"]))


def test_eager_too_and_hf_subset_flags_default_off():
    args = parse(["latency", "--device", "cpu"])
    validate_args(args)
    assert not args.eager_too and args.hf_num_prompts is None and not args.pagedllm_on_hf_subset


# ---- the HF subset -----------------------------------------------------------------------

def test_hf_subset_is_the_first_requests_with_their_own_lengths():
    w = wl.throughput_nanovllm()
    sub = wl.first_requests(w, 64)
    assert sub.name == w.name and sub.requests == w.requests[:64]
    assert sub.params["first_requests"] == 64 and sub.params["of_requests"] == 256
    assert sub.num_output_tokens == sum(r.output_len for r in w.requests[:64])
    assert wl.subset_label(sub) == "first 64 of 256 requests"
    assert wl.first_requests(w, None) is w and wl.first_requests(w, 256) is w
    assert wl.first_requests(w, 1000) is w and wl.subset_label(w) == ""
    with pytest.raises(ValueError):
        wl.first_requests(w, 0)


def test_the_subset_row_says_which_requests_it_ran_and_the_ratio_is_per_token():
    w = wl.throughput_nanovllm(num_prompts=8)
    sub = wl.first_requests(w, 2)
    hf = row("hf-transformers", "throughput-nanovllm", num_requests=2,
             output_tokens=sub.num_output_tokens, output_tok_s=100.0)
    add_labels(hf, sub)
    assert hf.settings["label"] == "first 2 of 8 requests"
    assert hf.settings["workload_subset"] == {
        "first_requests": 2, "of_requests": 8, "prompt_tokens": sub.num_prompt_tokens,
        "output_tokens": sub.num_output_tokens}
    ours = row(workload="throughput-nanovllm", num_requests=8, output_tok_s=1500.0)
    add_labels(ours, w)
    assert "label" not in ours.settings and "workload_subset" not in ours.settings
    results = [ours, hf]
    assert relative_to(results, "hf-transformers") == {0: 15.0, 1: 1.0}
    table = format_table(results)
    assert "reqs" in table.splitlines()[0] and "first 2 of 8 requests" in table
    assert "15.00x" in table
    (line,) = format_comparisons(results).splitlines()
    assert "first 2 of 8 requests" in line and line.endswith("15.00x")


def test_hf_gets_the_subset_of_throughput_and_prefix_but_all_of_latency():
    args = parse(["all", "--device", "cpu", "--hf-num-prompts", "3", "--num-prompts", "5",
                  "--input-len", "8:16", "--output-len", "2:4", "--prefix-len", "16"])
    for w in build_workloads(args):
        sub = hf_subset(w, args.hf_num_prompts)
        assert len(sub.requests) == (1 if w.name == "latency" else 3)
        assert sub.requests == w.requests[:len(sub.requests)]
        assert hf_subset(w, None) is w


def test_left_padding_puts_each_prompt_at_the_right_edge():
    batch = [wl.BenchRequest([5, 6, 7], 4), wl.BenchRequest([9], 2)]
    ids, mask = left_padded(batch, pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_cuda_warmup_meets_long_prompts_and_wider_batches_than_the_cpu_one():
    cpu, gpu = wl.warmup_workload(), wl.warmup_workload(device="cuda")
    assert len(cpu.requests) == 2 and len(gpu.requests) == 16
    assert max(r.prompt_len for r in gpu.requests) > 512
    assert gpu.requests[0].prompt_token_ids != wl.throughput_nanovllm().requests[0].prompt_token_ids


# ---- --eager-too -------------------------------------------------------------------------

def test_speedup_over_eager_pairs_rows_of_the_same_workload_dtype_and_caching():
    graphs = row(decode_tok_s=400.0, settings={"executor": "cuda graphs", "enforce_eager": False,
                                               "enable_prefix_caching": True, "label": "cuda graphs"})
    eager = row(decode_tok_s=100.0, settings={"executor": "eager", "enforce_eager": True,
                                              "enable_prefix_caching": True, "label": "eager"})
    other_dtype = row(dtype="float32", decode_tok_s=50.0,
                      settings={"executor": "cuda graphs", "enforce_eager": False,
                                "enable_prefix_caching": True})
    tput = row(workload="throughput", output_tok_s=9000.0, num_requests=256,
               settings={"executor": "cuda graphs", "enforce_eager": False,
                         "enable_prefix_caching": True})
    tput_eager = row(workload="throughput", output_tok_s=3000.0, num_requests=256,
                     settings={"executor": "eager", "enforce_eager": True,
                               "enable_prefix_caching": True})
    results = [graphs, other_dtype, tput, eager, tput_eager]
    speedups_over_eager(results)
    assert graphs.settings["speedup_over_eager"] == pytest.approx(4.0)
    assert tput.settings["speedup_over_eager"] == pytest.approx(3.0)
    for r in (other_dtype, eager, tput_eager):
        assert "speedup_over_eager" not in r.settings
    lines = format_comparisons(results).splitlines()
    assert lines == ["pagedllm latency bfloat16 on cuda: cuda graphs 400.0 vs eager 100.0 "
                     "decode tok/s: 4.00x",
                     "pagedllm throughput bfloat16 on cuda: cuda graphs 9000.0 vs eager 3000.0 "
                     "output tok/s: 3.00x"]


def test_table_shows_the_device_column_only_off_the_cpu():
    gpu = format_table([row(decode_tok_s=300.0)])
    cpu = format_table([row(decode_tok_s=30.0, device="cpu")])
    assert gpu.splitlines()[0].split()[:5] == ["workload", "engine", "dtype", "device", "thr"]
    assert "device" not in cpu.splitlines()[0] and "reqs" not in cpu.splitlines()[0]


# ---- measurements and the roofline -------------------------------------------------------

def test_median_seconds_is_the_middle_run_after_the_warmup():
    import time
    sleeps = iter([0.0, 0.0, 0.03, 0.001, 0.08])  # 2 warm-up calls, then 3 timed

    def fn():
        time.sleep(next(sleeps))

    assert 0.03 <= hardware.median_seconds(fn, 3, "cpu", warmup=2) < 0.07
    with pytest.raises(StopIteration):
        fn()                                       # exactly warm-up + timed calls ran
    with pytest.raises(ValueError):
        hardware.median_seconds(fn, 0)


def test_device_measurements_run_unchanged_on_cpu_tensors():
    gflops = hardware.device_matmul_gflops(torch.float32, n=128, iters=3, device="cpu")
    gbs = hardware.device_copy_gbs(nbytes=8 * 2**20, iters=3, device="cpu")
    assert 0.01 < gflops < 1e6 and 0.01 < gbs < 1e5


def test_cpu_measurement_keeps_its_fields_and_says_how_it_measured():
    m = hardware.measure_machine(1, [torch.float32], quick=True, device="cpu")
    assert m.device == "cpu" and m.device_name is None and m.matmul_size == 512
    assert m.bandwidth_gbs == m.memory_read_gbs > 0 and set(m.matvec_gbs) == {"float32"}
    assert m.bandwidth_method == hardware.CPU_BANDWIDTH_METHOD
    summary = m.summary()
    assert summary["device"] == "cpu" and summary["matmul_gflops"]["float32"] > 0


def test_w2_roofline_from_fake_gpu_measurements_is_weights_over_bandwidth():
    """Qwen3-0.6B in bf16, a fake H100 (700 TFLOP/s, 3000 GB/s): every decode step of W2
    is memory bound, its bytes the weights plus the K/V of its context."""
    cfg = qwen3_06b_config()
    layers, h, inter, vocab = 28, 1024, 3072, 151936
    q, kv = 16 * 128, 8 * 128
    weights = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter) + h * vocab
    kv_per_token = 2 * layers * kv
    machine = hardware.MachineMeasurement(16, {"bfloat16": 700e3}, 3000.0, {}, device="cuda",
                                          device_name="fake H100")
    w = wl.latency_w2()
    r = row(decode_tok_s=300.0, ttft_s=0.01)
    add_roofline(r, w, model_cost(cfg), machine)
    steps = range(128 + 1, 128 + 256)
    seconds = sum(2 * (weights + c * kv_per_token) / 3000e9 for c in steps)
    assert r.roofline["tok_s"] == pytest.approx(len(steps) / seconds)
    assert 2000 < r.roofline["tok_s"] < 3000            # ~1.2 GB a step at 3 TB/s
    assert r.roofline["bandwidth_gbs"] == 3000.0 and r.roofline["device"] == "cuda"
    assert r.roofline_fraction == pytest.approx(300.0 / r.roofline["tok_s"])
    prompt_flops = (128 * 2 * (weights - h * vocab) + 2 * h * vocab
                    + 128 * 129 // 2 * 4 * layers * q)
    assert r.roofline["ttft_seconds"] == pytest.approx(prompt_flops / 700e12)


def test_throughput_roofline_from_fake_gpu_measurements():
    cfg = qwen3_06b_config()
    cost = model_cost(cfg)
    machine = hardware.MachineMeasurement(16, {"bfloat16": 700e3}, 3000.0, {}, device="cuda")
    w = wl.throughput_nanovllm()
    r = row(workload=w.name, num_requests=256, output_tok_s=10000.0,
            elapsed_s=w.num_output_tokens / 10000.0)
    add_roofline(r, w, cost, machine)
    b = r.roofline
    steps = max(x.output_len for x in w.requests) - 1
    weight_bytes = 2 * cost.weight_params * steps
    assert b["min_gbytes"] * 1e9 > weight_bytes          # plus the K/V reads
    assert b["memory_seconds"] == pytest.approx(b["min_gbytes"] / 3000.0)
    assert b["compute_seconds"] == pytest.approx(b["gflop"] / 700e3)
    assert b["seconds"] == max(b["memory_seconds"], b["compute_seconds"])
    assert r.roofline_fraction == pytest.approx(b["seconds"] / r.elapsed_s)
    no_peak = row(workload=w.name, dtype="float16", output_tok_s=1.0, elapsed_s=1.0)
    add_roofline(no_peak, w, cost, machine)               # no float16 measured: no roofline
    assert no_peak.roofline is None


def test_gpu_machine_line_names_the_device_and_its_measurements():
    doc = {"machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.1,
                       "compute_capability": "9.0", "cuda": "13.0", "torch": "2.11.0",
                       "cpu": "host", "cpu_count": 16},
           "hardware": hardware.MachineMeasurement(
               16, {"bfloat16": 712345.0}, 2890.0, {}, device="cuda",
               device_name="NVIDIA H100 80GB HBM3", matmul_size=8192, seconds=2.5,
               bandwidth_method=hardware.CUDA_BANDWIDTH_METHOD).summary(),
           "model": {"name": "qwen3-0.6b", "cost": {"gflop_per_prompt_token": 0.88,
                                                    "gflop_per_output_token": 1.19}}}
    text = format_machine(doc)
    assert "NVIDIA H100 80GB HBM3" in text and "CUDA 13.0" in text
    assert "8192^3 matmul TFLOP/s bfloat16 712" in text and "2890 GB/s (read + written)" in text
    json.dumps(doc)


# ---- the random model's tokenizer ----------------------------------------------------------

def test_synthetic_tokenizer_covers_the_vocabulary_and_loads_as_an_hf_tokenizer(tmp_path):
    from pagedllm.loader.hf_tokenizer import tokenizer_from_hf_dir
    assert save_tokenizer(str(tmp_path), 1000, synthetic=True) == "synthetic"
    tok = tokenizer_from_hf_dir(str(tmp_path))
    assert tok.vocab_size == 1000 and tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.encode("t5 t999", add_special_tokens=False) == [5, 999]
    assert tok.decode([5, 999]) == "t5 t999"
    assert "qwen3-tiny" in PRESETS


# ---- on a GPU ------------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_measurement_is_quick_and_gives_the_memory_back():
    free_before, _ = torch.cuda.mem_get_info()
    m = hardware.measure_cuda(1, [torch.bfloat16], quick=True)
    free_after, _ = torch.cuda.mem_get_info()
    assert m.device == "cuda" and m.device_name == torch.cuda.get_device_name()
    assert m.matmul_gflops["bfloat16"] > 1e4 and m.memory_read_gbs > 100
    assert m.seconds < 10
    assert free_after > free_before - 512 * 2**20
    info = hardware.machine_info("cuda")
    assert info["gpu"] == m.device_name and info["cuda"] == torch.version.cuda


# ---- the device script's CPU rehearsal ------------------------------------------------------

@pytest.mark.slow
def test_gpu_bench_script_rehearsal_on_the_cpu(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "GPU_BENCH_SMOKE": "1", "PYTHON": sys.executable,
           "GPU_BENCH_MODEL": str(tmp_path / "model")}
    r = subprocess.run(["bash", os.path.join(root, "scripts", "gpu_bench.sh"),
                        str(tmp_path / "out")], capture_output=True, text=True, env=env,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tput = json.loads((tmp_path / "out" / "throughput-nanovllm.json").read_text())
    lat = json.loads((tmp_path / "out" / "latency-w2.json").read_text())
    engines = sorted((x["engine"], x["num_requests"]) for x in tput["results"])
    assert engines == [("hf-transformers", 4), ("pagedllm", 8)]
    hf = next(x for x in tput["results"] if x["engine"] == "hf-transformers")
    assert hf["settings"]["workload_subset"]["first_requests"] == 4
    labels = sorted(x["settings"]["label"] for x in lat["results"])
    # float32: the CPU decode stack where this CPU's kernels run it (AVX-512 or AVX2)
    stack = CpuDecodeStack.runs_here(torch.float32)
    assert labels == (["cpu decode stack", "eager"] if stack else ["eager", "model forward"])
    fast = next(x for x in lat["results"] if x["settings"]["label"] != "eager")
    assert fast["settings"]["speedup_over_eager"] > 0
    assert tput["device"] == "cpu" and tput["machine"]["device"] == "cpu"


# ---- --keep-going and the JSON written as the run goes ----------------------------------------

@pytest.mark.slow
def test_keep_going_notes_a_failed_engine_and_runs_the_next(tmp_path):
    """pagedllm cannot start (flash-attn on the CPU); HF transformers still runs, the JSON
    names the failure and the exit status says it."""
    out = tmp_path / "lat.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "latency", "--device", "cpu",
           "--attention-backend", "flash", "--compare", "hf", "--keep-going", "--threads", "1",
           "--input-len", "8", "--output-len", "4", "--latency-iters", "1", "--quick-machine",
           "--output-json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"})
    assert r.returncode == 1, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [x["engine"] for x in doc["results"]] == ["hf-transformers"]
    (failure,) = doc["failures"]
    assert "pagedllm" in failure and "flash" in failure
    assert "partial" not in doc
    assert "an engine failed" in r.stderr
