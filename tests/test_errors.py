"""The one error map: every typed error reaches the CLI and HTTP edges through ERROR_MAP,
and every HTTP error body carries a non-null machine-readable code."""

from __future__ import annotations

import importlib
import pkgutil

import httpx
import pytest

import edgeinfer
from edgeinfer import errors
from edgeinfer.errors import (
    ERROR_MAP, EdgeInferError, ErrorMapping, PreflightError, error_code, exit_code_for, http_status_for,
    mapping_for,
)

# The contract as the docs state it (docs/server.md, docs/preflight.md, the CLI's exit codes).
CONTRACT = {
    "EdgeInferError": (1, 500, "edgeinfer_error"),
    "LimitExceeded": (2, 422, "limit_exceeded"),
    "PreflightError": (2, 422, "preflight_failed"),
    "FileTooLargeError": (2, 413, "preflight_failed"),
    "MemoryPressureError": (2, 503, "preflight_failed"),
    "RequestError": (2, 400, "invalid_request"),
    "InvalidParam": (2, 400, "invalid_request"),
    "ProfileError": (2, 500, "profile_error"),
    "ServerSettingsError": (2, 500, "server_settings"),
    "ModelLoadError": (3, 500, "model_load_error"),
    "UnsupportedArchitectureError": (3, 500, "unsupported_architecture"),
    "BackendUnavailableError": (4, 503, "backend_unavailable"),
    "CapacityError": (5, 503, "capacity_exceeded"),
    "QueueFullError": (5, 503, "capacity_exceeded"),
    "ServerShuttingDown": (5, 503, "shutting_down"),
    "EngineBuildError": (6, 500, "engine_build_error"),
    "RequestTimedOut": (1, 504, "deadline_exceeded"),
    "RequestCancelled": (1, 499, "cancelled"),
    "EngineFailure": (1, 500, "internal_error"),
    "AuthenticationError": (1, 401, "invalid_api_key"),
    "ModelNotFound": (1, 404, "model_not_found"),
    "BodyTooLarge": (1, 413, "request_too_large"),
    "ModelNotReady": (1, 503, "model_not_ready"),
}


def every_error_class() -> set[type[EdgeInferError]]:
    for module in pkgutil.walk_packages(edgeinfer.__path__, "edgeinfer."):
        importlib.import_module(module.name)
    found, todo = set(), [EdgeInferError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_the_map_holds_the_documented_contract():
    got = {cls.__name__: (m.exit_code, m.http_status, m.code) for cls, m in ERROR_MAP.items()}
    assert got == CONTRACT


def test_no_error_class_chooses_its_own_status_exit_code_or_code():
    """Nothing outside the map knows a status: a class attribute would bypass it."""
    for cls in every_error_class():
        overridden = {"exit_code", "http_status", "code"} & set(vars(cls)) if cls is not EdgeInferError else set()
        assert not overridden, f"{cls.__module__}.{cls.__name__} sets {overridden}; add it to ERROR_MAP instead"
        assert mapping_for(cls).code


def test_a_subclass_outside_the_map_takes_its_nearest_listed_ancestor():
    class Unlisted(errors.FileTooLargeError):
        pass

    error = Unlisted("file_too_large", 10, 5)
    assert (exit_code_for(error), http_status_for(error)) == (2, 413)
    assert error.http_status == 413 and error.exit_code == 2  # the attributes read the map too


def test_a_preflight_refusal_is_coded_by_its_reason():
    error = PreflightError("image_too_large", 1600, 1024, "--on-oversize fit")
    assert error_code(error) == "image_too_large"
    assert error.to_dict()["code"] == "preflight_failed" and error.to_dict()["reason"] == "image_too_large"


def test_an_untyped_error_is_an_internal_error():
    assert mapping_for(ValueError) == ErrorMapping(1, 500, "internal_error")
    assert error_code(KeyError("x")) == "internal_error"


def test_the_engines_serving_errors_are_the_mapped_ones():
    from edgeinfer.errors import RequestCancelled, RequestTimedOut

    assert http_status_for(RequestTimedOut(1.0, 3)) == 504
    assert http_status_for(RequestCancelled("gone")) == 499


# --------------------------------------------------------------------------- the HTTP edge


@pytest.fixture(scope="module")
def demo_server():
    from edgeinfer.demo import DEMO_MODEL_DIR
    from edgeinfer.profiles import load_profile
    from edgeinfer.server import ServerSettings
    from tests.test_server import BASE_OVERRIDES, running_server

    profile = load_profile("cpu", [*BASE_OVERRIDES, "images.max_file_mb=1", "server.max_body_mb=2"])
    with running_server(ServerSettings(model_dir=DEMO_MODEL_DIR, profile=profile, backend="torch",
                                       api_key="k" * 16)) as url:
        yield url


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "code"), [
    ("GET", "/v1/nothing", {}, 404, "unknown_endpoint"),
    ("DELETE", "/v1/models", {}, 405, "method_not_allowed"),
    ("GET", "/v1/models", {"auth": False}, 401, "invalid_api_key"),
    ("POST", "/v1/chat/completions", {"content": b"{", "headers": {"content-type": "application/json"}},
     400, "invalid_json"),
    ("POST", "/v1/chat/completions", {"json": {"messages": 3}}, 422, "invalid_value"),
    ("POST", "/v1/chat/completions", {"content": b"x" * (3 * 2**20)}, 413, "request_too_large"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}], "model": "x"}},
     404, "model_not_found"),
])
def test_every_error_body_has_a_code(demo_server, method, path, kwargs, status, code):
    headers = {} if kwargs.pop("auth", True) is False else {"Authorization": "Bearer " + "k" * 16}
    headers.update(kwargs.pop("headers", {}))
    response = httpx.request(method, demo_server + path, headers=headers, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == code, error
