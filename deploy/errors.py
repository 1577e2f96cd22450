"""OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from .openai_schema import ErrorInfo, ErrorResponse


class ApiError(Exception):
    """A request the server answers with an error body instead of a result."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


def from_validation_error(error: ValidationError) -> ApiError:
    """400 naming the first bad field (or the body when the JSON itself is malformed)."""
    first = error.errors()[0]
    loc = [str(p) for p in first["loc"]]
    if first["type"] in ("json_invalid", "json_type"):
        return bad_request(f"the request body is not valid JSON: {first['msg']}", None,
                           code="invalid_json")
    # a union member's name (e.g. "str", "list[int]") is not a field: keep the field path
    fields = [p for p in loc if not (p[:1].islower() and ("[" in p or p in _TYPE_NAMES))]
    param = ".".join(fields) or None
    if first["type"] == "missing":
        return bad_request(f"missing required field {param!r}", param, code="missing_field")
    return bad_request(f"invalid value for {param!r}: {first['msg']}", param,
                       code="invalid_value")


_TYPE_NAMES = {"str", "int", "float", "bool", "none", "list", "dict"}


def unauthorized() -> ApiError:
    return ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error", code="invalid_api_key")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large")


def overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(503, message, type="server_error", code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


def engine_unavailable(message: str, retry_after_s: int = 5) -> ApiError:
    """503: the engine replica that ran the request stopped or was lost; a retry can succeed."""
    return ApiError(503, message, type="server_error", code="engine_unavailable",
                    headers={"Retry-After": str(retry_after_s)})
