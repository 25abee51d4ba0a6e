"""Stand-ins for what the proxy talks to, shared by tests/, sim/ and bench/.

``fakes.vllm``: vLLM's OpenAI server as the proxy sees it (answers, errors, adapter and pause
state); ``fakes.net``: a free port for a server started at run time. Standard library and
Starlette only, so a benchmark or the simulation imports them without test-only packages.
"""
