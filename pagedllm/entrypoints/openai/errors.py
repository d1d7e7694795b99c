"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the client caused or should know about, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"),
                      "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status,
                        headers=err.headers)


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming the field, e.g. `tools` or `messages.0.role`."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    param = _param(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        message = f"unsupported field {param!r}: pagedllm does not support it (yet)"
    else:
        message = f"invalid value for {param!r}: {first.get('msg')}" if param else str(first.get("msg"))
    return APIError(400, message, param)


def _param(loc: tuple) -> str | None:
    """`messages.0.role` from pydantic's location, without the `body` root and without the
    union-member tags (`str`, `list[int]`, ...) pydantic appends for union fields."""
    parts: list[str] = []
    for x in loc:
        if x == "body":
            continue
        if isinstance(x, str) and ("[" in x or x in _TYPE_TAGS):
            break
        parts.append(str(x))
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}
