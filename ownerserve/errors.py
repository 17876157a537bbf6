"""The project's exception hierarchy (one for the router and the workers);
`ownerserve.http.error_status_and_body` maps these to the OpenAI error shape in one place."""

from __future__ import annotations


class OwnerServeError(Exception):
    """Base of every error OwnerServe raises on purpose. `param` names the request field at
    fault, when there is one (the OpenAI error body's `param`)."""

    status_code = 500
    error_type = "internal_error"
    code: str | None = None
    param: str | None = None

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        if param is not None:
            self.param = param


class ConfigError(OwnerServeError):
    """A configuration file or value is invalid; the message names the file and the key."""

    status_code = 500
    error_type = "config_error"


class InvalidRequestError(OwnerServeError):
    status_code = 400
    error_type = "invalid_request_error"


class NotFoundError(OwnerServeError):
    """No such endpoint or resource (a worker id, an artifact)."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowedError(OwnerServeError):
    """The path exists but not for this HTTP method."""

    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class HTTPStatusError(OwnerServeError):
    """Another HTTP error raised by the web framework (an unknown status), with its status."""

    error_type = "invalid_request_error"

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class ModelNotFoundError(OwnerServeError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLargeError(OwnerServeError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class ClientDisconnected(OwnerServeError):
    """The client went away before its request body was read whole. Nobody is left to read
    an answer: a server that catches it sends nothing; mapped anyway, it is nginx's 499."""

    status_code = 499
    error_type = "client_closed_request"


class AuthenticationError(OwnerServeError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class RateLimitError(OwnerServeError):
    """Too many requests for now: the router's admission queue is full, or a request waited
    its bound in it. Sent with `Retry-After: retry_after_s`."""

    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class NoWorkerAvailableError(OwnerServeError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_worker_available"


class ShuttingDownError(OwnerServeError):
    """The router stopped before the request was served (its shutdown grace ran out)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "shutting_down"


class UpstreamError(OwnerServeError):
    status_code = 502
    error_type = "upstream_error"


class DirectoryUnavailableError(OwnerServeError):
    status_code = 503
    error_type = "directory_unavailable"


class StaleEpochError(OwnerServeError):
    """A write carried a fencing epoch older than the artifact's current one."""

    status_code = 409
    error_type = "conflict"
    code = "stale_epoch"


def openai_error_body(
    message: str, error_type: str, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    """The OpenAI error JSON shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_body_for(exc: OwnerServeError) -> dict[str, object]:
    """The OpenAI-shaped body for one of our exceptions."""
    return openai_error_body(str(exc), exc.error_type, exc.code, exc.param)
