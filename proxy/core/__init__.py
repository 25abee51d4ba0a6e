"""The pure, synchronous core: request -> routing key -> block hashes -> prefix index -> decision.

Nothing in this package performs I/O or imports HTTP/async libraries (tests/unit/test_core_purity.py
enforces it), so every routing rule is testable with plain tables and no event loop.
"""
