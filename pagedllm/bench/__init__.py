"""`pagedllm bench`: seeded workloads, pagedllm and its peers side by side, the roofline."""
