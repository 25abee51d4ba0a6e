"""One exception hierarchy for the whole proxy, rendered as OpenAI-shaped bodies
``{"error": {"message", "type", "param", "code"}}`` (what TRL, the OpenAI client and vLLM
speak). Pure Python: the synchronous core raises these too, so nothing here imports HTTP code.
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    """Base class: carries the HTTP status and the OpenAI error ``type`` it maps to."""

    status_code: int = 500
    error_type: str = "InternalServerError"
    # Seconds for a Retry-After header (a refusal that time is expected to lift), else None.
    retry_after: int | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status_code: int | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = details
        if status_code is not None:
            self.status_code = status_code

    def to_body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.status_code,
        }
        if self.details is not None:
            error["details"] = self.details
        return {"error": error}


class ConfigError(ProxyError):
    """Bad settings; raised at start-up, never while serving."""

    error_type = "ConfigError"


class InvalidRequest(ProxyError):
    status_code = 400
    error_type = "BadRequestError"


class Unauthorized(ProxyError):
    status_code = 401
    error_type = "AuthenticationError"


class Forbidden(ProxyError):
    status_code = 403
    error_type = "PermissionDeniedError"


class ModelNotFound(ProxyError):
    """No in-service replica has the adapter. Same shape as vLLM's own answer, so clients
    that already handle vLLM handle us."""

    status_code = 404
    error_type = "NotFoundError"


class PayloadTooLarge(ProxyError):
    status_code = 413
    error_type = "RequestTooLargeError"


class NotSupported(ProxyError):
    """A request the fleet cannot serve as a whole (e.g. KV-event state with the feature off)."""

    status_code = 501
    error_type = "NotImplementedError"


class Conflict(ProxyError):
    """A request that does not fit the proxy's current state (e.g. a weight update with no
    weight-transfer group formed through this proxy)."""

    status_code = 409
    error_type = "ConflictError"


class UpstreamUnavailable(ProxyError):
    """No replica could take the request (all ejected, unreachable, or draining)."""

    status_code = 502
    error_type = "BadGatewayError"


class UpstreamTimeout(ProxyError):
    status_code = 504
    error_type = "GatewayTimeoutError"


class BroadcastFailed(ProxyError):
    """A control-plane broadcast did not apply everywhere; ``details`` holds each replica's
    outcome so the operator sees exactly what happened and what was rolled back."""

    status_code = 502
    error_type = "BroadcastError"


class InconsistentFleet(ProxyError):
    """Replicas disagree on something that must be uniform (base model, block size)."""

    status_code = 502
    error_type = "InconsistentFleetError"
