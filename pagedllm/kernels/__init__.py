"""pagedllm's CPU kernels: the C++ sources (csrc/), their build (build.py), one typed
wrapper per op (ops.py) and what this CPU and build can run (probes.py).

This package is the only place that reaches the compiled extension or a private torch API;
models, layers and backends call ops.py and ask probes.py.
"""
