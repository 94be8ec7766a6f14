"""Typed errors of edgeinfer, and the one map from each to an exit code and an HTTP status.

Library code raises these; only the CLI and HTTP edges turn them into exit codes and
status codes, and both read :data:`ERROR_MAP` (through :func:`exit_code_for`,
:func:`http_status_for` and :func:`error_code`), so the mapping lives here and nowhere
else. A subclass that is not in the map takes its nearest listed ancestor's entry;
anything that is not an :class:`EdgeInferError` is a bug: exit 1, HTTP 500,
``internal_error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


class _Mapped:
    """A read-only attribute of an error class (or instance) that reads its entry in :data:`ERROR_MAP`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type) -> Any:
        return getattr(mapping_for(owner), self.name)


class EdgeInferError(Exception):
    """Base of every error edgeinfer raises on purpose.

    ``exit_code``, ``http_status`` and ``code`` read the class's entry in :data:`ERROR_MAP`
    (``BackendUnavailableError.exit_code`` is 4); no class sets them itself.
    """

    exit_code = _Mapped()
    http_status = _Mapped()
    code = _Mapped()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --------------------------------------------------------------------------- limits and input


class LimitExceeded(EdgeInferError):
    """A measured value went over a limit; carries both numbers and how to lift it."""

    def __init__(self, what: str, measured: float | int, limit: float | int,
                 override: str | None = None, reason: str | None = None) -> None:
        hint = f" (override: {override})" if override else ""
        super().__init__(f"{what} is {measured}, over the limit of {limit}{hint}")
        self.what = what
        self.measured = measured
        self.limit = limit
        self.override = override
        self.reason = reason or "limit_exceeded"


class PreflightError(EdgeInferError):
    """An image or a request failed preflight, before anything was scheduled.

    ``reason`` is a short stable code (``image_too_large``, ``decompression_bomb``,
    ``unsupported_format``, ``truncated``, ...) and is the error's machine-readable code at
    both edges; ``measured`` and ``limit`` are what was found and what is allowed;
    ``override`` names the flag or field that lifts the limit, or is ``None`` when nothing
    does. The message is one line naming all of them.

    Every reason answers HTTP 422 and CLI exit 2, except the two subclasses below.
    """

    def __init__(self, reason: str, measured: object, limit: object,
                 override: str | None = None, *, what: str = "value",
                 source: str | None = None) -> None:
        where = f"{source}: " if source else ""
        line = (f"{where}{reason}: {what} is {measured}, limit {limit}; "
                f"override: {override or 'none'}")
        # File names and decoder messages come from outside: keep the message one line.
        super().__init__(line.replace("\r", "\\r").replace("\n", "\\n"))
        self.reason = reason
        self.measured = measured
        self.limit = limit
        self.override = override
        self.what = what
        self.source = source

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "reason": self.reason, "message": self.message,
                "measured": self.measured, "limit": self.limit,
                "override": self.override, "source": self.source}


class FileTooLargeError(PreflightError):
    """The image file is over the byte limit: HTTP 413 (Content Too Large)."""


class MemoryPressureError(PreflightError):
    """The machine lacks the memory for the request right now: HTTP 503, retry later."""


class RequestError(EdgeInferError):
    """A request is malformed (wrong types, empty prompt, bad sampling values)."""


class InvalidParam(RequestError):
    """A request field is wrong; ``param`` names it the way OpenAI does (``messages[0].content``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QuantizeSettingsError(RequestError):
    """``edgeinfer quantize`` was asked for something it cannot do: ``what`` names the setting,
    ``value`` what was given and ``allowed`` what would work."""

    def __init__(self, what: str, value: object, allowed: str) -> None:
        super().__init__(f"{what} is {value}; allowed: {allowed}")
        self.what = what
        self.value = value
        self.allowed = allowed


# --------------------------------------------------------------------------- models, backends, engines


class ModelLoadError(EdgeInferError):
    """A checkpoint folder cannot be loaded: missing file, bad config, unknown family."""


class UnsupportedArchitectureError(ModelLoadError):
    def __init__(self, architectures: list[str] | None, supported: list[str], reason: str | None = None) -> None:
        super().__init__(
            f"unsupported architecture {architectures!r}{': ' + reason if reason else ''}; "
            f"supported: {', '.join(sorted(supported))}"
        )
        self.architectures = architectures
        self.supported = supported


class UnsupportedQuantizationError(ModelLoadError):
    """A checkpoint's ``quantization_config`` names a weight format edgeinfer does not load."""

    def __init__(self, found: str, supported: list[str]) -> None:
        super().__init__(f"unsupported quantization format {found}; supported: {'; '.join(supported)}")
        self.found = found
        self.supported = supported


class BackendUnavailableError(EdgeInferError):
    """The requested backend (or execution provider) is not installed or not usable here."""


class EngineBuildError(EdgeInferError):
    """An engine cannot be built, or a built one is missing, stale or corrupt.

    ``artifact`` names the file or folder at fault and ``fix`` the command that repairs it,
    when one does.
    """

    def __init__(self, message: str, *, artifact: str | None = None, fix: str | None = None) -> None:
        where = f"{artifact}: " if artifact else ""
        hint = f" (fix: {fix})" if fix else ""
        super().__init__(f"{where}{message}{hint}")
        self.artifact = artifact
        self.fix = fix


# --------------------------------------------------------------------------- configuration


class ProfileError(EdgeInferError):
    """A device profile is invalid: unknown key, wrong type or inconsistent budget.

    ``file`` is where the profile came from (a path, a profile name or ``--set``) and
    ``field`` the dotted path inside it (``memory.kv_device_budget_mb``), so a message
    always points at the one value to change.
    """

    def __init__(self, reason: str, *, file: str | None = None, field: str | None = None) -> None:
        where = ": ".join(part for part in (file, field) if part)
        super().__init__(f"{where}: {reason}" if where else reason)
        self.reason = reason
        self.file = file
        self.field = field

    def located(self, *, file: str | None = None, prefix: str | None = None) -> "ProfileError":
        """The same error seen from further out: inside section ``prefix`` of ``file``."""
        field = ".".join(part for part in (prefix, self.field) if part) or None
        return ProfileError(self.reason, file=file or self.file, field=field)


class ServerSettingsError(EdgeInferError):
    """The daemon's flags and profile make an unsafe or impossible combination."""


# --------------------------------------------------------------------------- serving requests


class CapacityError(EdgeInferError):
    """The engine cannot take the request now (queue full, KV pool exhausted)."""


class QueueFullError(CapacityError):
    """Every slot and every queue place is taken, or the engine is shutting down."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerShuttingDown(CapacityError):
    """The server stopped before this request was done (queued, or running past the grace period)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimedOut(EdgeInferError):
    """The request ran past its deadline and was cancelled."""

    def __init__(self, timeout_s: float, completion_tokens: int) -> None:
        super().__init__(f"request ran past its deadline of {timeout_s:g} s after {completion_tokens} tokens "
                         f"and was cancelled (override: --set server.request_timeout_s=N, or fewer max_tokens)")
        self.timeout_s = timeout_s
        self.completion_tokens = completion_tokens


class RequestCancelled(EdgeInferError):
    """The caller went away (closed its connection) before the answer was done."""


class EngineFailure(EdgeInferError):
    """The engine raised something that is not one of our typed errors: a bug."""


class AuthenticationError(EdgeInferError):
    """The server has an API key and the request sent none, or another."""


class ModelNotFound(EdgeInferError):
    """The request names a model other than the one served."""


class BodyTooLarge(EdgeInferError):
    """The request body is over the server's byte limit."""

    def __init__(self, measured: int | str, limit: int) -> None:
        limit_mb = limit // 2**20
        super().__init__(f"request body is {measured} bytes, over the limit of {limit} bytes ({limit_mb} MiB) "
                         f"(override: --set server.max_body_mb=N)")
        self.limit = limit


class ModelNotReady(EdgeInferError):
    """The server is still loading its model, failed to load it, or is shutting down."""


# --------------------------------------------------------------------------- the one map


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    """Where one error type ends: the CLI's exit status, the HTTP status, the stable code."""

    exit_code: int
    http_status: int
    code: str


ERROR_MAP: MappingProxyType[type[EdgeInferError], ErrorMapping] = MappingProxyType({
    EdgeInferError: ErrorMapping(1, 500, "edgeinfer_error"),
    # bad input: exit 2
    LimitExceeded: ErrorMapping(2, 422, "limit_exceeded"),
    PreflightError: ErrorMapping(2, 422, "preflight_failed"),  # the body's code is its reason
    FileTooLargeError: ErrorMapping(2, 413, "preflight_failed"),
    MemoryPressureError: ErrorMapping(2, 503, "preflight_failed"),
    RequestError: ErrorMapping(2, 400, "invalid_request"),
    InvalidParam: ErrorMapping(2, 400, "invalid_request"),
    ProfileError: ErrorMapping(2, 500, "profile_error"),
    ServerSettingsError: ErrorMapping(2, 500, "server_settings"),
    # the machine or the model: exit 3..6
    ModelLoadError: ErrorMapping(3, 500, "model_load_error"),
    UnsupportedArchitectureError: ErrorMapping(3, 500, "unsupported_architecture"),
    BackendUnavailableError: ErrorMapping(4, 503, "backend_unavailable"),
    CapacityError: ErrorMapping(5, 503, "capacity_exceeded"),
    QueueFullError: ErrorMapping(5, 503, "capacity_exceeded"),
    ServerShuttingDown: ErrorMapping(5, 503, "shutting_down"),
    EngineBuildError: ErrorMapping(6, 500, "engine_build_error"),
    # serving: only the daemon raises these
    RequestTimedOut: ErrorMapping(1, 504, "deadline_exceeded"),
    RequestCancelled: ErrorMapping(1, 499, "cancelled"),  # nginx's "client closed request"; only metrics read it
    EngineFailure: ErrorMapping(1, 500, "internal_error"),
    AuthenticationError: ErrorMapping(1, 401, "invalid_api_key"),
    ModelNotFound: ErrorMapping(1, 404, "model_not_found"),
    BodyTooLarge: ErrorMapping(1, 413, "request_too_large"),
    ModelNotReady: ErrorMapping(1, 503, "model_not_ready"),
})

UNTYPED = ErrorMapping(1, 500, "internal_error")


def mapping_for(error_type: type[BaseException]) -> ErrorMapping:
    """The entry of ``error_type`` or of its nearest ancestor in :data:`ERROR_MAP`."""
    for cls in error_type.__mro__:
        if cls in ERROR_MAP:
            return ERROR_MAP[cls]
    return UNTYPED


def exit_code_for(error: BaseException) -> int:
    return mapping_for(type(error)).exit_code


def http_status_for(error: BaseException) -> int:
    return mapping_for(type(error)).http_status


def error_code(error: BaseException) -> str:
    """The machine-readable code both edges send: a preflight refusal's reason, else the map's code."""
    if isinstance(error, PreflightError):
        return error.reason
    return mapping_for(type(error)).code


def error_detail(error: BaseException) -> dict[str, Any] | None:
    """The structured fields an edge adds beside the message (a preflight refusal's numbers), if any."""
    return error.to_dict() if isinstance(error, PreflightError) else None
