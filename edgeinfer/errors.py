"""Typed errors of edgeinfer.

Library code raises these; only the CLI and HTTP edges turn them into exit codes and
status codes, through :func:`exit_code_for` and :func:`http_status_for`, so the mapping
lives in one place.
"""

from __future__ import annotations


class EdgeInferError(Exception):
    """Base of every error edgeinfer raises on purpose.

    ``exit_code`` and ``http_status`` are the class's place in the one mapping; a
    subclass overrides them rather than a caller choosing ad hoc.
    """

    exit_code: int = 1
    http_status: int = 500
    code: str = "edgeinfer_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LimitExceeded(EdgeInferError):
    """A measured value went over a limit; carries both numbers and how to lift it."""

    exit_code = 2
    http_status = 422
    code = "limit_exceeded"

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
    ``unsupported_format``, ``truncated``, ...); ``measured`` and ``limit`` are what was
    found and what is allowed; ``override`` names the flag or field that lifts the limit,
    or is ``None`` when nothing does. The message is one line naming all of them.

    Every reason answers HTTP 422 and CLI exit 2, except the two subclasses below.
    """

    exit_code = 2
    http_status = 422
    code = "preflight_failed"

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

    http_status = 413


class MemoryPressureError(PreflightError):
    """The machine lacks the memory for the request right now: HTTP 503, retry later."""

    http_status = 503


class ModelLoadError(EdgeInferError):
    """A checkpoint folder cannot be loaded: missing file, bad config, unknown family."""

    exit_code = 3
    http_status = 500
    code = "model_load_error"


class UnsupportedArchitectureError(ModelLoadError):
    code = "unsupported_architecture"

    def __init__(self, architectures: list[str] | None, supported: list[str]) -> None:
        super().__init__(
            f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(supported))}"
        )
        self.architectures = architectures
        self.supported = supported


class BackendUnavailableError(EdgeInferError):
    """The requested backend (or execution provider) is not installed or not usable here."""

    exit_code = 4
    http_status = 503
    code = "backend_unavailable"


class EngineBuildError(EdgeInferError):
    """An engine cannot be built, or a built one is missing, stale or corrupt.

    ``artifact`` names the file or folder at fault and ``fix`` the command that repairs it,
    when one does.
    """

    exit_code = 6
    http_status = 500
    code = "engine_build_error"

    def __init__(self, message: str, *, artifact: str | None = None, fix: str | None = None) -> None:
        where = f"{artifact}: " if artifact else ""
        hint = f" (fix: {fix})" if fix else ""
        super().__init__(f"{where}{message}{hint}")
        self.artifact = artifact
        self.fix = fix


class RequestError(EdgeInferError):
    """A request is malformed (wrong types, empty prompt, bad sampling values)."""

    exit_code = 2
    http_status = 400
    code = "invalid_request"


class CapacityError(EdgeInferError):
    """The engine cannot take the request now (queue full, KV pool exhausted)."""

    exit_code = 5
    http_status = 503
    code = "capacity_exceeded"


class ProfileError(EdgeInferError):
    """A device profile is invalid: unknown key, wrong type or inconsistent budget.

    ``file`` is where the profile came from (a path, a profile name or ``--set``) and
    ``field`` the dotted path inside it (``memory.kv_device_budget_mb``), so a message
    always points at the one value to change.
    """

    exit_code = 2
    http_status = 500
    code = "profile_error"

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


class RequestCancelled(EdgeInferError):
    """The caller went away (closed its connection), or the server stopped, before the answer
    was done."""

    http_status = 499  # nginx's "client closed request": no one reads it, metrics do
    code = "cancelled"


class RequestTimedOut(EdgeInferError):
    """The request ran past its deadline and was cancelled; ``completion_tokens`` were made."""

    http_status = 504
    code = "deadline_exceeded"

    def __init__(self, timeout_s: float, completion_tokens: int) -> None:
        super().__init__(f"request ran past its deadline of {timeout_s:g} s after {completion_tokens} tokens "
                         f"and was cancelled (override: --set server.request_timeout_s=N, or fewer max_tokens)")
        self.timeout_s = timeout_s
        self.completion_tokens = completion_tokens


def exit_code_for(error: BaseException) -> int:
    return error.exit_code if isinstance(error, EdgeInferError) else 1


def http_status_for(error: BaseException) -> int:
    return error.http_status if isinstance(error, EdgeInferError) else 500
