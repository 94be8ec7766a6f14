"""The daemon under hostile input, overload and shutdown: a real server on 127.0.0.1, real clients.

Each test is one way a careless or hostile client could stall the others, push the process
toward the OOM killer or get a 5xx. The counts and sizes are bounded so the module runs in
well under a minute of server time on a 2-core CPU; the time bounds asserted are loose (many
times what the fixed path takes) and far under what the unfixed path took.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from PIL import Image

from edgeinfer.demo import DEMO_MODEL_DIR
from edgeinfer.errors import MemoryPressureError, PreflightError, QueueFullError, ServerSettingsError
from edgeinfer.preflight import ImageRules
from edgeinfer.profiles import load_profile
from edgeinfer.server import ServerSettings
from edgeinfer.server.decoding import DECODE_BYTES_PER_PIXEL, DecodeBudget, decode_peak_bytes
from tests.test_server import (
    BASE_OVERRIDES, LONG, REPO, data_uri, free_socket, held_blocks, image_message, metric, png_bytes,
    running_server, wait_for, wait_ready,
)

API_KEY = "hostile-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# One engine slot and one queue place; an 8 MiB body; a decode budget of one large image
# at a time (total_mb 4096 leaves 1 GiB past the reserve and KV budget: an eighth of it is
# under the floor of one largest decode plus a request's images, about 287 MiB).
HOSTILE_OVERRIDES = (*BASE_OVERRIDES, "server.max_concurrent=1", "server.max_queue=1", "server.max_body_mb=8",
                     "images.max_file_mb=4", "memory.total_mb=4096")
REMOTE_TIMEOUT_S = 2.0
QUICK = {"max_tokens": 2}


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **QUICK, **extra}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert error["code"], f"error without a code: {error}"
    return error


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    settings = ServerSettings(model_dir=DEMO_MODEL_DIR, profile=load_profile("cpu", HOSTILE_OVERRIDES),
                              api_key=API_KEY, backend="torch", allow_remote_images=True,
                              remote_image_timeout_s=REMOTE_TIMEOUT_S)
    with running_server(settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(hostile) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hostile, headers=AUTH, timeout=60) as c:
        yield c


@contextmanager
def busy_slots(url: str) -> Iterator[None]:
    """Hold the one engine slot and the one queue place with two long streams."""
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "stream": True, **LONG}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as first, \
            httpx.Client(base_url=url, headers=AUTH, timeout=60) as second, \
            first.stream("POST", "/v1/chat/completions", json=body) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        queued = threading.Thread(target=_open_stream, args=(second, body), daemon=True)
        queued.start()
        wait_for(lambda: metric(url, "edgeinfer_queue_depth", AUTH) == 1, what="one queued request")
        yield
    queued.join(30)
    wait_for(lambda: held_blocks(url, AUTH) == 0, timeout_s=30, what="every block free")


def _open_stream(client: httpx.Client, body: dict) -> None:
    """A queued stream: its headers come once it is admitted; then it leaves."""
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)
    except httpx.HTTPError:
        pass  # its client was closed under it: the test is over


# --------------------------------------------------------------------------- 1, 6: text and context


def test_a_huge_prompt_is_refused_by_its_length_without_stalling_others(client):
    """A 6 MB prompt is refused from its character count (never tokenized: the message counts
    characters, not tokens); a valid request sent meanwhile is answered."""
    huge = chat("hello world " * 500_000)
    refused: dict = {}
    sender = threading.Thread(target=lambda: refused.update(response=client.post("/v1/chat/completions", json=huge)))
    sender.start()
    valid = client.post("/v1/chat/completions", json=chat("What color is the circle?"))
    sender.join(60)
    assert valid.status_code == 200, valid.text
    error = error_of(refused["response"], 422)
    assert "characters" in error["message"] and "max_context_tokens" in error["message"]


def test_requests_that_can_never_fit_get_their_4xx_on_a_busy_server(hostile, client):
    with busy_slots(hostile):
        over_context = client.post("/v1/chat/completions", json=chat("hi", max_tokens=100_000))
        assert error_of(over_context, 422)["code"] == "limit_exceeded"
        # Under the character bound, so it is tokenized (off the engine thread), then refused.
        long_prompt = client.post("/v1/chat/completions", json=chat("hello " * 5000))
        assert "max_context_tokens" in error_of(long_prompt, 422)["message"]
        surrogate = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", '
                                b'"content": "\\ud800"}], "max_tokens": 2}', headers={"content-type": "application/json"})
        error_of(surrogate, 422)
        fine = client.post("/v1/chat/completions", json=chat("hi"))
        assert error_of(fine, 503)["code"] == "capacity_exceeded" and int(fine.headers["retry-after"]) >= 1


# --------------------------------------------------------------------------- 4, 12: types and text


SURROGATE = '"\\ud800 hello"'  # JSON can escape a lone surrogate; UTF-8 cannot carry it


def raw_post(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


def test_a_lone_surrogate_is_422_in_plain_stream_and_batch(client):
    plain = f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}], "max_tokens": 2}}'
    error = error_of(raw_post(client, "/v1/chat/completions", plain), 422)
    assert error["code"] == "invalid_text" and error["param"] == "messages[0].content"
    stream = plain[:-1] + ', "stream": true}'
    assert error_of(raw_post(client, "/v1/chat/completions", stream), 422)["code"] == "invalid_text"
    parts = (f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {SURROGATE}}}]}}], '
             f'"max_tokens": 2}}')
    assert error_of(raw_post(client, "/v1/chat/completions", parts), 422)["code"] == "invalid_text"
    batch = f'{{"requests": [{parts}]}}'
    assert error_of(raw_post(client, "/v1/chat/completions/batch", batch), 422)["code"] == "invalid_text"


@pytest.mark.parametrize("field", [{"stream": "yes"}, {"max_tokens": True}, {"max_tokens": "5"},
                                   {"temperature": "0"}, {"ignore_eos": 1}])
def test_loose_types_are_422(client, field):
    error = error_of(client.post("/v1/chat/completions", json=chat("hi", **field)), 422)
    assert error["code"] == "invalid_value" and error["param"] == next(iter(field))


def test_every_error_has_a_machine_readable_code(hostile, client):
    not_utf8 = client.post("/v1/chat/completions", content=b'{"messages": "\xff\xfe"}',
                           headers={"content-type": "application/json"})
    assert error_of(not_utf8, 400)["code"] == "invalid_body"
    deep = client.post("/v1/chat/completions", content=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                       headers={"content-type": "application/json"})
    assert error_of(deep, 400)["code"] == "invalid_body"
    field = client.post("/v1/vqa", files={"image": ("a.png", b"x", "image/png")},
                        data={"question": "q" * (2 * 2**20)})
    assert error_of(field, 400)["code"] == "invalid_body"
    assert error_of(client.get("/v1/nothing"), 404)["code"] == "unknown_endpoint"
    assert error_of(client.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"


# --------------------------------------------------------------------------- 2, 3: batches and decoding


def test_an_oversized_batch_is_counted_before_any_item_is_read(hostile, client):
    """8,000 items are refused from their count alone (one error, none about an item, no image
    looked at); a batch over the server's capacity is refused before any image is read."""
    before = metric(hostile, "edgeinfer_preflight_rejections_total", AUTH)
    not_an_image = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    item = {"messages": image_message(not_an_image, "q"), "max_tokens": 1}
    response = client.post("/v1/chat/completions/batch", json={"requests": [item] * 8000})
    error = error_of(response, 422)
    assert "at most 256 requests" in error["message"] and "8000" in error["message"]
    over_capacity = client.post("/v1/chat/completions/batch", json={"requests": [item] * 3})
    assert "capacity of 2" in error_of(over_capacity, 400)["message"]
    assert metric(hostile, "edgeinfer_preflight_rejections_total", AUTH) == before  # no image was looked at


def test_large_decodes_run_one_at_a_time_within_the_budget(hostile):
    """Four requests with a 20 MP PNG (240 MB to decode, a few KB on the wire) at once: the
    budget lets one decode at a time, and each is still answered."""
    big = data_uri(png_bytes(Image.new("RGB", (5000, 4000), (200, 30, 30))))
    body = {"messages": image_message(big, "What color is the circle?"), "on_oversize": "fit", "max_tokens": 1}
    capacity = metric(hostile, "edgeinfer_image_decode_bytes", AUTH, state="capacity")
    one = 5000 * 4000 * DECODE_BYTES_PER_PIXEL
    assert one <= capacity < 2 * one

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=hostile, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(4)))

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses if r.status_code != 503] == [200] * sum(
        r.status_code != 503 for r in responses), [r.text[:200] for r in responses]
    assert sum(r.status_code == 200 for r in responses) >= 2  # the queue holds 2; the rest may be told to retry
    peak = metric(hostile, "edgeinfer_image_decode_bytes", AUTH, state="peak")
    assert one <= peak <= capacity
    assert metric(hostile, "edgeinfer_image_decode_bytes", AUTH, state="reserved") == 0


def test_decode_budget_waits_refuses_and_keeps_the_floor():
    async def scenario() -> None:
        available = [10_000]
        budget = DecodeBudget(100, floor_bytes=1_000, max_waiting=1, available=lambda: available[0])
        with pytest.raises(PreflightError) as never:
            async with budget.reserve(101, "image"):
                pass
        assert never.value.reason == "decode_memory" and never.value.limit == 100
        order: list[str] = []
        entered = asyncio.Event()

        async def hold(name: str, nbytes: int, release: asyncio.Event) -> None:
            async with budget.reserve(nbytes, name):
                order.append(name)
                entered.set()
                await release.wait()

        release_a, release_b = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(hold("a", 60, release_a))
        await entered.wait()
        b = asyncio.create_task(hold("b", 60, release_b))
        await asyncio.sleep(0.01)
        assert budget.usage().waiting == 1 and order == ["a"]  # b does not fit beside a
        with pytest.raises(QueueFullError):  # a second waiter is over max_waiting
            async with budget.reserve(60, "c"):
                pass
        async with budget.reserve(40, "small"):  # fits beside a: never waits behind b
            assert budget.usage().reserved_bytes == 100
        release_a.set()
        await a
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and budget.usage().reserved_bytes == 60
        release_b.set()
        await b
        assert budget.usage().peak_bytes == 100 and budget.usage().reserved_bytes == 0
        available[0] = 1_050  # 50 bytes over the floor: a 60-byte decode would cross it
        with pytest.raises(MemoryPressureError):
            async with budget.reserve(60, "image"):
                pass
        assert budget.usage().reserved_bytes == 0 and budget.usage().waiting == 0

    asyncio.run(scenario())


def test_decode_peak_is_read_from_the_header():
    rules = ImageRules.from_profile(load_profile("cpu").images)
    small = png_bytes(Image.new("RGB", (300, 200)))
    assert decode_peak_bytes(small, rules) == 300 * 200 * DECODE_BYTES_PER_PIXEL
    assert decode_peak_bytes(b"garbage", rules) == rules.decode_cap * DECODE_BYTES_PER_PIXEL


# --------------------------------------------------------------------------- 7: remote images


class _Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            if self.path.startswith("/hop"):  # each hop answers under the timeout; all of them do not
                n = int(self.path[4:] or 0)
                time.sleep(REMOTE_TIMEOUT_S * 0.6)
                self.send_response(302)
                self.send_header("Location", f"/hop{n + 1}")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/trickle":  # one header byte a second: no single read ever times out
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n":
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.5)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Origin)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.mark.parametrize("path", ["/hop0", "/trickle"])
def test_the_remote_image_timeout_is_one_deadline(client, origin, path):
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json={"messages": image_message(f"{origin}{path}", "q")})
    seconds = time.perf_counter() - started
    assert "took over" in error_of(response, 400)["message"]
    assert seconds < REMOTE_TIMEOUT_S + 1.5


# --------------------------------------------------------------------------- 10: the API key


def test_the_key_is_checked_before_the_body_is_parsed(hostile):
    broken = httpx.post(f"{hostile}/v1/chat/completions", content=b'{"messages": [',
                        headers={"content-type": "application/json"}, timeout=10)
    assert error_of(broken, 401)["code"] == "invalid_api_key"
    assert broken.headers["www-authenticate"] == "Bearer"
    huge = httpx.post(f"{hostile}/v1/chat/completions", content=b"x" * 2**20,
                      headers={"content-type": "application/json", "x-api-key": "wrong"}, timeout=10)
    error_of(huge, 401)
    assert httpx.get(f"{hostile}/v1/models", headers={"x-api-key": API_KEY}, timeout=10).status_code == 200


def test_an_empty_api_key_from_the_environment_is_refused(tmp_path):
    with pytest.raises(ServerSettingsError, match="empty"):
        ServerSettings.build(DEMO_MODEL_DIR, "cpu", environ={"EDGEINFER_API_KEY": ""})
    with pytest.raises(ServerSettingsError, match="empty"):
        ServerSettings.build(DEMO_MODEL_DIR, "cpu", environ={"EDGEINFER_API_KEY": "  "})
    assert ServerSettings.build(DEMO_MODEL_DIR, "cpu", environ={}).api_key is None
    command = [sys.executable, "-m", "edgeinfer.cli.main", "serve", "--profile", "cpu", "--port", "0"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EDGEINFER_API_KEY": ""})
    assert done.returncode == 2 and "API key is empty" in done.stdout + done.stderr


# --------------------------------------------------------------------------- 5: shutdown past the grace period


def test_shutdown_past_the_grace_period_answers_everyone_and_exits_0():
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    overrides = (*BASE_OVERRIDES, "server.max_concurrent=1", "server.max_queue=2", "server.shutdown_grace_s=1")
    command = [sys.executable, "-m", "edgeinfer.cli.main", "serve", "--model", str(DEMO_MODEL_DIR), "--profile",
               "cpu", "--backend", "torch", "--port", str(port), "--log-level", "warning",
               *[arg for item in overrides for arg in ("--set", item)]]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "EDGEINFER_API_KEY": API_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process=process)
        body = {"messages": [{"role": "user", "content": "tell me a story"}], "stream": True, **LONG}
        queued: dict = {}

        def queued_client() -> None:
            plain = {**body, "stream": False}
            queued["response"] = httpx.post(f"{url}/v1/chat/completions", json=plain, headers=AUTH, timeout=60)

        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            waiter = threading.Thread(target=queued_client)
            waiter.start()
            wait_for(lambda: metric(url, "edgeinfer_queue_depth", AUTH) == 1, what="one queued request")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        waiter.join(30)
        assert rest[-1] == "data: [DONE]"
        last_event = json.loads(rest[-2].removeprefix("data: "))
        assert last_event["error"]["code"] == "shutting_down"
        refused = queued["response"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert process.wait(timeout=30) == 0, process.stdout.read().decode()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
