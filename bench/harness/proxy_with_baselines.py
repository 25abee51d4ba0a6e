"""``python -m bench.harness.proxy_with_baselines [proxy arguments]``: rollout-proxy with the
benchmark baselines (bench/harness/baseline_policies.py) choosable as
PROXY_POLICY=round_robin|least_loaded. Everything else is ``python -m proxy``."""

from __future__ import annotations

from bench.harness.baseline_policies import register
from proxy.__main__ import main

if __name__ == "__main__":
    register()
    main()
