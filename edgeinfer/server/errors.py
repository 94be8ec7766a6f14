"""Every error the daemon answers, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

The status and the ``code`` come from :data:`edgeinfer.errors.ERROR_MAP`, the one map of
each typed error to its exit code and HTTP status; this module only shapes the body.
FastAPI's own validation and HTTP errors are reshaped here too, so a client never sees
another shape, and every body carries a non-null ``code``. A 503 carries ``Retry-After``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# The typed errors the daemon raises live with the rest; imported here for the routes.
from edgeinfer.errors import (  # noqa: F401
    AuthenticationError, BodyTooLarge, EdgeInferError, InvalidParam, ModelNotFound, ModelNotReady,
    PreflightError, error_code, error_detail, http_status_for,
)

log = logging.getLogger(__name__)

# OpenAI's error types by status; anything else 4xx is an invalid request.
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
          504: "timeout"}
# Codes of the errors Starlette and FastAPI raise themselves: routing, the body limit while
# reading, and a body that cannot be parsed at all (not UTF-8, JSON nested past the parser's
# depth, a multipart field over its size).
_STARLETTE_CODES = {400: "invalid_body", 404: "unknown_endpoint", 405: "method_not_allowed",
                    413: "request_too_large"}
# Validation errors whose own type is a stable code (raised by the wire schemas' validators).
_VALIDATION_CODES = frozenset({"invalid_text"})
DEFAULT_RETRY_AFTER_S = 1


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, status: int, *, code: str, param: str | None = None,
               detail: dict[str, Any] | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": error_type(status), "param": param, "code": code}
    if detail:
        error["edgeinfer"] = detail
    return {"error": error}


def error_payload(error: BaseException) -> dict[str, Any]:
    """OpenAI's error JSON for any exception, wherever it is sent (a response, a batch item, an SSE
    event); untyped ones are logged and told apart from the client's fault."""
    status = http_status_for(error)
    if isinstance(error, EdgeInferError):
        return error_body(error.message, status, code=error_code(error), param=_param(error),
                          detail=error_detail(error))
    log.error("unhandled %s", type(error).__name__, exc_info=error)
    return error_body(f"internal server error ({type(error).__name__}); see the server log", status,
                      code=error_code(error))


def error_response(error: BaseException) -> JSONResponse:
    status = http_status_for(error)
    return JSONResponse(error_payload(error), status_code=status, headers=_headers(error, status))


def _param(error: EdgeInferError) -> str | None:
    if isinstance(error, PreflightError):
        return error.source
    return getattr(error, "param", None)


def _headers(error: BaseException, status: int) -> dict[str, str]:
    if status == 503:
        return {"Retry-After": str(getattr(error, "retry_after_s", DEFAULT_RETRY_AFTER_S))}
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    return {}


def param_path(loc: Sequence[Any]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header", "form", "file")]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "tagged-union[")):
            out += f".{part}" if out else str(part)
    return out


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """Body that is not JSON: 400; JSON of the wrong shape: 422 naming the first fields at fault."""
    errors = exc.errors()
    invalid_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if invalid_json is not None:
        reason = (invalid_json.get("ctx") or {}).get("error", "not JSON")
        position = invalid_json["loc"][-1] if len(invalid_json.get("loc", ())) > 1 else "?"
        return JSONResponse(error_body(f"request body is not valid JSON: {reason} (at character {position})",
                                       400, code="invalid_json"), status_code=400)
    if any(_raw_body(e) for e in errors):
        return JSONResponse(error_body("request body must be a JSON object sent with "
                                       "Content-Type: application/json", 400, code="invalid_json"),
                            status_code=400)
    coded = [e for e in errors if e.get("type") in _VALIDATION_CODES]
    errors = coded or errors  # the error with a stable code first: it is the one to fix
    described = [f"{param_path(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first = param_path(errors[0].get("loc", ())) if errors else None
    code = coded[0]["type"] if coded else "invalid_value"
    return JSONResponse(error_body("invalid request: " + "; ".join(described) + more, 422,
                                   code=code, param=first or None), status_code=422)


def _raw_body(error: dict[str, Any]) -> bool:
    return tuple(error.get("loc", ())) == ("body",) and isinstance(error.get("input"), (bytes, str))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EdgeInferError)
    async def typed(request: Request, exc: EdgeInferError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = ("the request body cannot be parsed (not UTF-8, JSON nested too deep, or a form field "
                       "over its size limit)")
        elif exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}; see /docs"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        code = _STARLETTE_CODES.get(exc.status_code, "http_error")
        return JSONResponse(error_body(message, exc.status_code, code=code), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def untyped(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)
