"""Benchmarks for rollout-proxy: replica simulator, AsyncGRPO-shaped workload, side-by-side runners.

Nothing here is imported by `proxy/` or `trainer/`; the benchmarks talk to the proxy only over HTTP
(and `run_micro` reads `proxy.core` directly, as a library).
"""
