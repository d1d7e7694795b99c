"""Results out: a table a person reads, JSON a program reads, a PNG bar chart."""
from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.bench.results import BenchResult, SpecRow


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or value != value else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _primary(r: BenchResult) -> float | None:
    """The figure engines are ranked by: decode tok/s for latency, output tok/s otherwise."""
    return r.decode_tok_s if r.workload == "latency" else r.output_tok_s


def relative_to(results: list[BenchResult], engine: str) -> dict[int, float]:
    """Each row's primary figure divided by ``engine``'s on the same workload and dtype."""
    base = {(r.workload, r.dtype): _primary(r) for r in results
            if r.engine == engine}
    out: dict[int, float] = {}
    for i, r in enumerate(results):
        b, v = base.get((r.workload, r.dtype)), _primary(r)
        if b and v:
            out[i] = v / b
    return out


def format_table(results: list[BenchResult]) -> str:
    """One line per row; a "device" column once any row ran off the CPU (threads then
    matter only to the CPU rows), a "reqs" column once a row ran a subset of its workload."""
    on_gpu = any(r.device != "cpu" for r in results)
    subset = any("workload_subset" in r.settings for r in results)
    header = ["workload", "engine", "dtype", "device", "thr", "reqs", "out tok/s", "total tok/s",
              "req/s", "TTFT ms", "decode tok/s", "roofline", "serial", "vs HF", "exact",
              "versions"]
    shown = [h for h in header if (h != "device" or on_gpu) and (h != "reqs" or subset)]
    vs_hf = relative_to(results, "hf-transformers")
    rows = []
    for i, r in enumerate(results):
        engine = r.engine + (f" [{r.settings['label']}]" if r.settings.get("label") else "")
        cells = dict(zip(header, [
            r.workload, engine, r.dtype, r.device, str(r.threads) if r.device == "cpu" else "-",
            str(r.num_requests), _fmt(r.output_tok_s), _fmt(r.total_tok_s), _fmt(r.req_s, ".2f"),
            _fmt(None if r.ttft_s is None else 1000 * r.ttft_s, ".0f"), _fmt(r.decode_tok_s),
            _pct(r.roofline_fraction), _pct(r.serial_fraction),
            _fmt(vs_hf.get(i), ".2f") + "x" if i in vs_hf else "-",
            "yes" if r.exact_output_lens else "NO",
            " ".join(f"{k} {v}" for k, v in r.versions.items())]))
        rows.append([cells[h] for h in shown])
    widths = [max(len(h), *(len(row[c]) for row in rows)) if rows else len(h)
              for c, h in enumerate(shown)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(shown, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def format_spec_table(rows: list[SpecRow]) -> str:
    """`bench spec`: tok/s, speedup over speculation off (of the same engine), the same for
    decoding alone (prompts' prefill left out), acceptance, and whether the greedy tokens
    equal those without speculation; then, for a peer (llama.cpp), whether its greedy
    tokens equal pagedllm's without speculation."""
    header = ["workload", "streams", "engine", "speculation", "out tokens", "seconds", "tok/s",
              "speedup", "decode tok/s", "decode speedup", "accepted", "mean acc. len",
              "in draft", "same tokens"]
    body = []
    for r in rows:
        body.append([r.workload, str(r.streams), r.engine, r.speculation, str(r.output_tokens),
                     f"{r.seconds:.2f}", f"{r.tok_s:.1f}",
                     _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
                     _fmt(r.decode_tok_s, ".1f"),
                     _fmt(r.decode_speedup, ".2f") + ("x" if r.decode_speedup else ""),
                     _pct(r.acceptance_rate),
                     _fmt(r.mean_acceptance_length, ".2f"),
                     _pct(r.draft_seconds / r.seconds if r.draft_seconds is not None else None),
                     {None: "-", True: "yes", False: "NO"}[r.same_tokens_as_off]])
    widths = [max(len(h), *(len(b[c]) for b in body)) if body else len(h)
              for c, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    lines += _peer_token_notes(rows)
    return "\n".join(lines)


def _peer_token_notes(rows: list[SpecRow]) -> list[str]:
    """One line per peer "off" row: its greedy tokens against pagedllm's (other kernels may
    round differently; reported, not an error)."""
    out = []
    for r in rows:
        if r.vs_pagedllm_off is None or r.speculation != "off":
            continue
        d = r.vs_pagedllm_off["first_difference"]
        where = ("identical" if d is None else
                 f"differ from request {d['request']} token {d['token']} on "
                 f"(lengths {d['lengths'][0]} vs {d['lengths'][1]})")
        out.append(f"{r.engine} off vs pagedllm off, {r.workload} x{r.streams}: greedy tokens {where}")
    return out


def _eager_pair(r: BenchResult) -> tuple:
    """What an --eager-too row shares with the row it is compared with."""
    return (r.engine, r.workload, r.dtype, r.num_requests, r.settings.get("enable_prefix_caching"))


def _eager_rows(results: list[BenchResult]) -> dict[tuple, BenchResult]:
    return {_eager_pair(r): r for r in results
            if r.settings.get("enforce_eager") and r.settings.get("executor") == "eager"}


def speedups_over_eager(results: list[BenchResult]) -> None:
    """Give each row of an --eager-too pair its executor's speedup over the eager run of
    the same engine, workload, dtype, requests and prefix caching (settings
    "speedup_over_eager": decode tok/s for W2, output tok/s otherwise)."""
    eager = _eager_rows(results)
    for r in results:
        base = eager.get(_eager_pair(r))
        if base is None or r.settings.get("enforce_eager"):
            continue
        v, b = _primary(r), _primary(base)
        if v and b:
            r.settings["speedup_over_eager"] = v / b


def format_comparisons(results: list[BenchResult]) -> str:
    """The ratios a reader looks for, spelt out: each executor over eager (--eager-too),
    and every engine over HF transformers where HF ran a subset of the requests."""
    lines = []
    eager = _eager_rows(results)
    for r in results:
        speedup = r.settings.get("speedup_over_eager")
        if speedup is None:
            continue
        base = eager[_eager_pair(r)]
        what = "decode tok/s" if r.workload == "latency" else "output tok/s"
        lines.append(f"{r.engine} {r.workload} {r.dtype} on {r.device}: "
                     f"{r.settings.get('executor')} {_fmt(_primary(r))} vs eager "
                     f"{_fmt(_primary(base))} {what}: {speedup:.2f}x")
    hf = [r for r in results if r.engine == "hf-transformers" and "workload_subset" in r.settings]
    for h in hf:
        sub = h.settings["workload_subset"]
        for r in results:
            if r.engine == "hf-transformers" or (r.workload, r.dtype) != (h.workload, h.dtype):
                continue
            if not (_primary(r) and _primary(h)):
                continue
            lines.append(f"{r.label} on {r.workload} ({r.num_requests} requests) "
                         f"{_fmt(_primary(r))} out tok/s vs HF transformers on the first "
                         f"{sub['first_requests']} of {sub['of_requests']} requests "
                         f"{_fmt(_primary(h))} out tok/s: {_primary(r) / _primary(h):.2f}x")
    return "\n".join(lines)


def format_bounds(results: list[BenchResult]) -> str:
    """One line per throughput workload and dtype: what its roofline and serial bound are
    made of (the "roofline" and "serial" columns are each engine's fraction of them)."""
    lines, seen = [], set()
    for r in results:
        b = r.roofline
        if not b or "serial_seconds" not in b or (r.workload, r.dtype) in seen:
            continue
        seen.add((r.workload, r.dtype))
        prompt_s = b["prompt_gflop"] / b["peak_gflops"]
        lines.append(
            f"bounds {r.workload} {r.dtype}: all FLOPs at the peak {b['compute_seconds']:.2f} s, "
            f"decode bytes at the bandwidth {b['memory_seconds']:.2f} s -> roofline "
            f"{b['seconds']:.2f} s ({b['tok_s']:,.0f} out tok/s); prompts at the peak "
            f"{prompt_s:.2f} s then decode -> serial {b['serial_seconds']:.2f} s "
            f"({b['serial_tok_s']:,.0f} out tok/s)")
    return "\n".join(lines)


def format_serving(results: list[BenchResult]) -> str:
    lines = []
    for r in results:
        if not r.serving:
            continue
        s = r.serving
        lines.append(f"serving {r.engine} at {s['base_url']} (rate {s['request_rate']} req/s): "
                     f"{s['completed']} ok / {s['failed']} failed in {s['duration_s']:.1f} s, "
                     f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
                     f"{s['total_token_throughput']:.1f} total tok/s")
        lines.append(f"  {'metric':8} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}  (ms)")
        for metric in ("ttft", "tpot", "itl", "e2el"):
            m = s[metric]
            lines.append(f"  {metric.upper():8} " + " ".join(
                f"{_fmt(m[k], '.1f'):>9}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def format_machine(doc: dict[str, Any]) -> str:
    hw, m = doc["hardware"], doc["machine"]
    if hw.get("device") == "cuda":
        return _format_gpu(doc)
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in hw["matmul_gflops"].items())
    mv = ", ".join(f"{k} {v:.1f}" for k, v in hw["matvec_gbs"].items())
    return (f"machine: {m.get('cpu', '?')}, {m.get('cpu_count')} cores, {hw['threads']} threads, "
            f"load average at start {m.get('load_average')}\n"
            f"measured: matmul peak GFLOP/s {peaks}; memory read {hw['memory_read_gbs']:.1f} GB/s; "
            f"torch matvec streams GB/s {mv}\n" + _model_line(doc))


def _format_gpu(doc: dict[str, Any]) -> str:
    hw, m = doc["hardware"], doc["machine"]
    n = hw.get("matmul_size")
    peaks = ", ".join(f"{k} {v / 1e3:.0f}" for k, v in hw["matmul_gflops"].items())
    return (f"device: {m.get('gpu', hw.get('device_name'))} ({m.get('gpu_memory_gib')} GiB, "
            f"compute capability {m.get('compute_capability')}), CUDA {m.get('cuda')}, "
            f"torch {m.get('torch')}; host {m.get('cpu', '?')}, {m.get('cpu_count')} cores\n"
            f"measured in {hw.get('seconds')} s: {n}^3 matmul TFLOP/s {peaks}; "
            f"copy bandwidth {hw['memory_read_gbs']:.0f} GB/s (read + written)\n"
            + _model_line(doc))


def _model_line(doc: dict[str, Any]) -> str:
    cost = doc["model"]["cost"]
    return (f"model: {doc['model']['name']}, {cost['gflop_per_prompt_token']:.3f} GFLOP per "
            f"prompt token, {cost['gflop_per_output_token']:.3f} per generated token "
            "(+ attention)")


def write_json(doc: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


def write_chart(results: list[BenchResult], path: str, title: str) -> str | None:
    """One panel per workload, one bar per engine and dtype; roofline as a dashed line.

    Returns None when written, else why not (matplotlib missing).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'pagedllm[bench]'): no chart"
    workloads = list(dict.fromkeys(r.workload for r in results if _primary(r) is not None))
    if not workloads:
        return "no throughput or latency figures to chart"
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.5), squeeze=False)
    for ax, name in zip(axes[0], workloads):
        rows = [r for r in results if r.workload == name and _primary(r) is not None]
        labels = [r.label.replace(" (", "\n(") for r in rows]
        values = [_primary(r) for r in rows]
        ax.bar(range(len(rows)), values, color=[_color(r.engine) for r in rows])
        for x, r in enumerate(rows):
            bound = (r.roofline or {}).get("tok_s")
            if bound:
                ax.hlines(bound, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
            value = _primary(r)
            ax.annotate(f"{value:.0f}" if value >= 10 else f"{value:.2g}", (x, value),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("decode tokens/s" if name == "latency" else "output tokens/s")
    fig.suptitle(title + "\ndashed: the workload's roofline in that dtype", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _color(engine: str) -> str:
    return {"pagedllm": "tab:blue", "hf-transformers": "tab:orange",
            "llama.cpp": "tab:green"}.get(engine, "tab:gray")
