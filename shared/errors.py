"""One error type per client-visible failure, each with its TGI-style ``error_type`` and
HTTP status; the API maps them to responses in one place."""

from __future__ import annotations


class InflightqError(Exception):
    error_type: str = "generation"  # TGI's name for the failure, in TGI's bodies
    http_status: int = 500  # TGI's status for it
    openai_status: int | None = None  # OpenAI's status, where it differs from TGI's
    subtype: str | None = None  # a name more specific than error_type (OpenAI's error code)

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    @property
    def code(self) -> str:
        return self.subtype or self.error_type

    def to_dict(self) -> dict[str, str]:
        body = {"error": self.message, "error_type": self.error_type}
        if self.field:
            body["field"] = self.field
        return body


class ValidationError(InflightqError):
    """A request that cannot be taken as it is: TGI's 422, OpenAI's 400 (its SDK's BadRequestError)."""

    error_type = "validation"
    http_status = 422
    openai_status = 400


class ModelNotFoundError(ValidationError):
    """A model this deployment does not serve: a 422 on TGI's routes, OpenAI's 404 ``model_not_found`` on its own."""

    openai_status = 404
    subtype = "model_not_found"


class AdapterNotFoundError(ModelNotFoundError):
    """A LoRA adapter (an OpenAI ``model``, TGI's ``adapter_id``) the deployment does not have: 404 on every route."""

    http_status = 404


class MalformedBodyError(ValidationError):
    """A body that is not JSON (or none at all)."""

    subtype = "invalid_json"


class UnsupportedParameterError(ValidationError):
    """A parameter this server deliberately does not implement (logit_bias, adapter_id, ...): a 400
    naming it on every route, as OpenAI answers a parameter it does not take. Silently ignoring it
    would change what the client asked for; a 422 would read as a malformed value."""

    http_status = 400
    subtype = "unsupported_parameter"


class PayloadTooLargeError(InflightqError):
    error_type = "payload_too_large"
    http_status = 413


class HeadersTooLargeError(InflightqError):
    error_type = "headers_too_large"
    http_status = 431


class AuthenticationError(InflightqError):
    error_type = "authentication"
    http_status = 401


class NotFoundError(InflightqError):
    error_type = "not_found"
    http_status = 404


class ConflictError(InflightqError):
    """A request id that is already in use (a reused id never touches the request that owns it)."""

    error_type = "conflict"
    http_status = 409


class OverloadedError(InflightqError):
    error_type = "overloaded"
    http_status = 429


class LimitError(InflightqError):
    """A 429 that names the limit it hit (``limit``: its name, ``value``: its size) and when to retry."""

    http_status = 429

    def __init__(
        self,
        message: str,
        *,
        limit: str | None = None,
        value: int | None = None,
        retry_after: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message, field=field)
        self.limit = limit
        self.value = value
        self.retry_after = retry_after

    @property
    def code(self) -> str:
        return self.subtype or self.limit or self.error_type


class TenantOverloadedError(LimitError, OverloadedError):
    """One tenant has ``value`` requests queued for a model, its limit (``max_queued``): that tenant
    alone is refused; other tenants' requests are still taken."""

    subtype = "tenant_overloaded"

    def __init__(self, message: str, *, tenant: str | None = None, value: int | None = None) -> None:
        super().__init__(message, limit="tenant_max_queued", value=value)
        self.tenant = tenant


class RateLimitedError(LimitError):
    """A key past its requests or tokens per minute (``limit``: requests_per_minute or tokens_per_minute)."""

    error_type = "rate_limited"


class UnavailableError(InflightqError):
    """Redis is unreachable or no worker serves the model."""

    error_type = "unavailable"
    http_status = 503


class SlowReaderError(InflightqError):
    """A streaming client fell too far behind its events (``stream_buffer_events``) and was
    dropped; it only ever arrives as the stream's last event."""

    error_type = "slow_reader"
    http_status = 503


class GenerationError(InflightqError):
    """The engine failed on this request (or it was dead-lettered)."""

    error_type = "generation"
    http_status = 424


class IncompleteGenerationError(InflightqError):
    error_type = "incomplete_generation"
    http_status = 500


class CancelledError(InflightqError):
    error_type = "cancelled"
    http_status = 499


class ExpiredError(InflightqError):
    """The request's deadline passed before it finished.

    408, a client error: the deadline is the client's own choice, and a 5xx would page
    operators (the 5xx alert in deploy/prometheus/alerts.yml) for every client that set a tight one.
    OpenAI's and huggingface_hub's clients treat 408 as a timeout."""

    error_type = "expired"
    http_status = 408


ERROR_TYPES: dict[str, type[InflightqError]] = {
    cls.error_type: cls
    for cls in (
        ValidationError,
        PayloadTooLargeError,
        HeadersTooLargeError,
        AuthenticationError,
        NotFoundError,
        ConflictError,
        OverloadedError,
        RateLimitedError,
        UnavailableError,
        SlowReaderError,
        GenerationError,
        IncompleteGenerationError,
        CancelledError,
        ExpiredError,
    )
}


def error_from_type(error_type: str, message: str) -> InflightqError:
    return ERROR_TYPES.get(error_type, GenerationError)(message)
