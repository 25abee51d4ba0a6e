"""Stand-ins for what the proxy talks to, shared by tests/, sim/ and bench/.

``fakes.vllm``: vLLM's OpenAI server as the proxy sees it (answers, errors, adapter and pause
state); ``fakes.net``: a free port for a server started at run time; ``fakes.httpx_relay``: the
data path's client for in-process replicas. Standard library, Starlette and the proxy's own
dependencies only, so a benchmark or the simulation imports them without test-only packages.
"""
