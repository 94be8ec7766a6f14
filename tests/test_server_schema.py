"""Schemathesis against the live server's /openapi.json: whatever the schema allows, no 5xx.

Examples are bounded (count per operation and generation mode, and generated answers are
capped at a few tokens) so the whole module takes seconds on a 2-core CPU.

The cases come from schemathesis' Hypothesis strategies, run by a plain Hypothesis test
per operation, rather than through schemathesis' pytest plugin (``from_fixture``): that
plugin rewrites private attributes of pytest's test items, which newer pytest releases
removed, so the test would break with pytest while the server is fine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from edgeinfer.profiles import load_profile  # noqa: E402
from edgeinfer.server import ServerSettings  # noqa: E402
from tests.test_server import BASE_OVERRIDES, running_server  # noqa: E402

MAX_EXAMPLES = 25
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def schema_server(checkpoint) -> Iterator[str]:
    profile = load_profile("cpu", [*BASE_OVERRIDES, "images.max_file_mb=1", "server.max_body_mb=2",
                                   "runtime.max_context_tokens=512", "runtime.prefill_chunk_tokens=256"])
    with running_server(ServerSettings(model_dir=checkpoint("smolvlm"), profile=profile, backend="torch")) as url:
        yield url


@pytest.fixture(scope="module")
def operations(schema_server):
    schema = schemathesis.openapi.from_url(f"{schema_server}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def bounded(body):
    """Keep a generated chat short: the point is the server's answers, not long generations."""
    if not isinstance(body, dict):
        return
    for item in body.get("requests", []) if isinstance(body.get("requests"), list) else [body]:
        if not isinstance(item, dict):
            continue
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(item.get(key), int) and not isinstance(item.get(key), bool):
                item[key] = max(1, min(item[key], MAX_TOKENS))
        if isinstance(item.get("min_tokens"), int):
            item["min_tokens"] = 0
        if item.get("ignore_eos") is True:
            item["ignore_eos"] = False
        if "max_tokens" not in item and "max_completion_tokens" not in item and "messages" in item:
            item["max_tokens"] = MAX_TOKENS


def check_case(case, base_url: str) -> None:
    bounded(case.body)
    if case.path == "/v1/vqa" and isinstance(case.body, dict):
        case.body["max_tokens"] = MAX_TOKENS
    response = case.call(base_url=base_url, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert error["code"], f"{case.method} {case.path} -> {response.status_code} without a code: {error}"


def run_operation(operation, mode: GenerationMode, base_url: str) -> None:
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        check_case(case, base_url)

    check()


def test_schema_lists_every_endpoint(operations):
    paths = {operation.path for operation in operations}
    assert {"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/vqa", "/v1/models",
            "/health", "/ready", "/metrics"} <= paths


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors(operations, schema_server, mode):
    failures, tested = [], set()
    for operation in operations:
        try:
            run_operation(operation, mode, schema_server)
        except Unsatisfiable:
            continue  # nothing to send wrong: an operation without parameters has no negative case
        except Exception as error:  # each operation's falsifying example, all reported together
            failures.append(f"{operation.label}: {type(error).__name__}: {error}")
        tested.add(operation.path)
    assert not failures, "\n\n".join(failures)
    assert {"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/vqa"} <= tested
