"""Build of the one C extension, proxy.core._native (the metadata is pyproject.toml's).

The per-request parse + pack + hash of a token-id completion runs in C (proxy/core/_native.c,
issue 12); proxy/core/native.py chooses it or the pure-Python reference (PROXY_NATIVE).
``optional=True``: without a C compiler the install still succeeds and the proxy runs the
reference path (its start-up log and the proxy_native_info metric say which one runs;
PROXY_NATIVE=on refuses to start without the module). The image's build stage has a compiler
and its runtime stage checks that the module imports (Dockerfile).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.core._native",
            sources=["proxy/core/_native.c"],
            depends=["proxy/core/vendor/xxhash.h"],
            optional=True,
            # Floats computed as Python computes them (route_tokens mirrors CostModel.cost):
            # no fused multiply-add, which would round differently and break ties.
            extra_compile_args=["-ffp-contract=off"],
        )
    ]
)
