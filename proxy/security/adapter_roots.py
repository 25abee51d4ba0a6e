"""``PROXY_ADAPTER_ROOTS``: which directories ``lora_path`` may name."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.checks import has_control, normalize_root, normpath
from proxy.errors import InvalidRequest


class AdapterRoots:
    """Checked on the string before any replica sees the load: absolute, no control characters,
    no '..' segments (normalising '..' is unsound with symlinks on the replica); the rest is
    normalised and must equal or lie below a root. Why each rule: docs/security.md."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(normalize_root(r) for r in roots)

    def allows(self, normalized: str) -> bool:
        return any(
            normalized == root or normalized.startswith(root.rstrip("/") + "/")
            for root in self.roots
        )

    def check(self, path: str) -> None:
        """Raise InvalidRequest (400, param lora_path) unless ``path`` is under a root."""
        problem: str | None = None
        if not path.startswith("/"):
            problem = "must be an absolute path"
        elif has_control(path):
            problem = "must not contain control characters"
        elif ".." in path.split("/"):
            problem = "must not contain '..' segments"
        elif not self.allows(normpath(path)):
            problem = "is outside the allowed adapter roots"
        if problem is not None:
            raise InvalidRequest(
                f"'lora_path' {problem} (PROXY_ADAPTER_ROOTS: {', '.join(self.roots)})",
                param="lora_path",
            )
