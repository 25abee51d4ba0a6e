"""Build of the one C extension, proxy.core._native (the metadata is pyproject.toml's).

The pure primitives of a token-id completion (scan and pack the prompt, chain its block hashes)
run in C (proxy/core/_native.c); proxy/core/native.py chooses them or the pure-Python
reference (PROXY_NATIVE).
``optional=True``: without a C compiler the install still succeeds and the proxy runs the
reference path (its start-up log and the proxy_native_info metric say which one runs;
PROXY_NATIVE=on refuses to start without the module). The image's build stage has a compiler
and its runtime stage checks that the module imports (Dockerfile).
"""

import os
import tempfile

from setuptools import Extension, setup

LIBCRYPTO_PROBE = """#include <openssl/evp.h>
int main(void) { EVP_MD *md = EVP_MD_fetch(NULL, "SHA256", NULL); EVP_MD_free(md); return 0; }
"""


def libcrypto_links() -> bool:
    """Whether OpenSSL 3's libcrypto (headers and library: Debian's libssl-dev) compiles and
    links here. With it, vllm_chain computes vLLM's sha256 block digests in C with the library
    hashlib uses; without it, it declines them and the proxy hashes those in Python (the
    extension still builds)."""
    from distutils.ccompiler import new_compiler  # setuptools' copy on Python >= 3.12

    compiler = new_compiler()
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write(LIBCRYPTO_PROBE)
        try:
            objects = compiler.compile([source], output_dir=tmp)
            compiler.link_executable(objects, os.path.join(tmp, "probe"), libraries=["crypto"])
        except Exception:  # no compiler, no headers, no library: all mean "without"
            return False
    return True


OPENSSL = libcrypto_links()

setup(
    ext_modules=[
        Extension(
            "proxy.core._native",
            sources=["proxy/core/_native.c"],
            depends=["proxy/core/vendor/xxhash.h"],
            optional=True,
            define_macros=[("PROXY_HAVE_OPENSSL", "1")] if OPENSSL else [],
            libraries=["crypto"] if OPENSSL else [],
        )
    ]
)
