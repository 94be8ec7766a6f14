"""The HTTP daemon, end to end: a real uvicorn server on 127.0.0.1 (random port), real clients.

The served model is the bundled demo model: answers are checked against the synthetic
pictures' known answers, and against the text ``Engine.generate`` gives directly.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from PIL import Image

from edgeinfer.demo import DEMO_MODEL_DIR
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.engine.async_engine import AsyncEngine, GenerationRequest
from edgeinfer.errors import RequestTimedOut, ServerShuttingDown
from edgeinfer.profiles import load_profile
from edgeinfer.server import ServerSettings, ServerSettingsError, create_app
from edgeinfer.server.daemon import build_server

API_KEY = "test-key-0123456789"
REPO = Path(__file__).resolve().parents[1]
# No disk tier: tests write nothing outside their temporary folders.
BASE_OVERRIDES = ("kv.device_blocks=512", "runtime.max_batch_size=2", "memory.disk_tier_mb=0")
LONG = {"max_tokens": 2000, "ignore_eos": True}  # a generation that runs for seconds


# --------------------------------------------------------------------------- helpers


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_message(uri: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": question}]}]


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_ready(url: str, timeout_s: float = 60.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout_s} s")


@contextmanager
def running_server(settings: ServerSettings) -> Iterator[str]:
    """uvicorn in a thread, on a socket bound to 127.0.0.1 by us (no port race)."""
    sock = free_socket()
    server = build_server(settings, create_app(settings), log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_ready(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def metric(url: str, name: str, headers: dict | None = None, **labels: str) -> float:
    """One sample of /metrics, summed over the label values not given."""
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total, found = total + float(match.group(3)), True
    assert found or name.endswith("_total"), f"{name}{labels} not in /metrics"
    return total


def held_blocks(url: str, headers: dict | None = None) -> float:
    """Device KV blocks some sequence owns (or that are moving): not free, not idle in the prefix cache."""
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    states = dict(re.findall(r'^edgeinfer_kv_blocks\{[^}]*state="(\w+)",tier="device"\}\s+(\S+)$', text, re.M))
    assert states, "no device KV blocks in /metrics"
    return sum(float(v) for state, v in states.items() if state not in ("free", "idle"))


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return DEMO_MODEL_DIR


@pytest.fixture(scope="module")
def question() -> tuple[Image.Image, str]:
    """The demo picture and a question about it."""
    from edgeinfer.demo import synthetic

    return synthetic.demo_picture(), "What color is the circle?"


@pytest.fixture(scope="module")
def reference(model_dir, question) -> str:
    """What the engine answers directly, greedy, 12 tokens at most: the right answer."""
    image, text = question
    engine = Engine.load(model_dir, profile=load_profile("cpu", BASE_OVERRIDES), backend="torch")
    answer = engine.generate(text, [image], SamplingParams(max_new_tokens=12)).text
    assert answer.strip().lower() == "red"
    return answer


@pytest.fixture(scope="module")
def served(model_dir) -> Iterator[str]:
    profile = load_profile("cpu", [*BASE_OVERRIDES, "images.max_file_mb=1", "server.max_body_mb=2",
                                   "server.max_concurrent=2", "server.max_queue=4"])
    with running_server(ServerSettings(model_dir=model_dir, profile=profile, api_key=API_KEY,
                                       backend="torch")) as url:
        yield url


@pytest.fixture(scope="module")
def client(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0, timeout=60)


# --------------------------------------------------------------------------- answers


def test_openai_client_gets_the_engines_answer(openai_client, question, reference, model_dir):
    image, text = question
    model = openai_client.models.list().data[0].id
    reply = openai_client.chat.completions.create(
        model=model, messages=image_message(data_uri(png_bytes(image)), text), max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == reference
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 0
    report = reply.model_extra["edgeinfer"]["images"][0]
    assert report["original_size"] == list(image.size) and report["action"] == "none"


def test_openai_client_streams_the_same_answer(openai_client, question, reference):
    image, text = question
    stream = openai_client.chat.completions.create(
        model=openai_client.models.list().data[0].id, stream=True, max_tokens=12,
        messages=image_message(data_uri(png_bytes(image)), text), stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == reference
    assert len(finish) == 1 and chunks[-1].usage.completion_tokens >= 1


def test_stream_and_plain_answers_agree(client, question, reference):
    image, text = question
    body = {"messages": image_message(data_uri(png_bytes(image)), text), "max_tokens": 12, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["edgeinfer"]["images"][0]["final_size"] == list(image.size)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == reference


def test_demo_model_answers_synthetic_questions_right(openai_client):
    from edgeinfer.demo import synthetic

    picture = png_bytes(synthetic.demo_picture())
    for text, expected in synthetic.DEMO_QUESTIONS.items():
        reply = openai_client.chat.completions.create(
            model=openai_client.models.list().data[0].id, max_tokens=4, temperature=0,
            messages=image_message(data_uri(picture), text))
        assert reply.choices[0].message.content.strip().lower() == expected, text


def test_vqa_takes_a_plain_multipart_post(served, question, reference):
    image, text = question
    response = httpx.post(f"{served}/v1/vqa", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          files={"image": ("frame.png", png_bytes(image), "image/png")},
                          data={"question": text, "max_tokens": "12"})
    assert response.status_code == 200, response.text
    assert response.json()["answer"] == reference
    missing = httpx.post(f"{served}/v1/vqa", headers={"Authorization": f"Bearer {API_KEY}"},
                         data={"question": text}, timeout=60)
    assert missing.status_code == 422 and "image" in missing.json()["error"]["message"]


def test_batch_answers_each_item(client, question, reference):
    image, text = question
    good = {"messages": image_message(data_uri(png_bytes(image)), text), "max_tokens": 12}
    bad = {"messages": image_message("data:image/png;base64,@@@", text)}
    response = client.post("/v1/chat/completions/batch", json={"requests": [good, bad, good]})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["choices"][0]["message"]["content"] for d in (data[0], data[2])] == [reference, reference]
    assert "base64" in data[1]["error"]["message"]
    # A batch item's error is the body the single endpoint sends for the same request.
    alone = client.post("/v1/chat/completions", json=bad)
    set_fields = {k: v for k, v in data[1]["error"].items() if v is not None}
    assert set_fields == {k: v for k, v in alone.json()["error"].items() if v is not None}


def test_probes_and_models(served, client):
    assert httpx.get(f"{served}/health").json() == {"status": "ok", "sleeping": False, "throttled": False,
                                                    "throttle_reasons": []}
    assert httpx.get(f"{served}/ready").json()["status"] == "ready"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1


def test_fit_downscales_and_says_so(client, question):
    _, text = question
    wide = Image.new("RGB", (1100, 60), (200, 30, 30))
    body = {"messages": image_message(data_uri(png_bytes(wide)), text), "max_tokens": 2, "on_oversize": "fit"}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    report = response.json()["edgeinfer"]["images"][0]
    assert (report["original_size"], report["final_size"], report["action"]) == ([1100, 60], [1024, 56],
                                                                                "downscaled")


# --------------------------------------------------------------------------- errors


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def test_missing_or_wrong_api_key_is_401(served, question):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    error = error_of(httpx.post(f"{served}/v1/chat/completions", json=body), 401)
    assert "API key" in error["message"]
    error_of(httpx.post(f"{served}/v1/chat/completions", json=body,
                        headers={"Authorization": "Bearer wrong"}), 401)
    error_of(httpx.get(f"{served}/metrics"), 401)


def test_invalid_json_is_400(client):
    error = error_of(client.post("/v1/chat/completions", content=b'{"messages": [',
                                 headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]


def test_wrong_types_are_422_naming_the_field(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}
    error = error_of(client.post("/v1/chat/completions", json=body), 422)
    assert error["param"] == "max_tokens"
    error = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "robot"}]}), 422)
    assert error["param"].startswith("messages[0].role")


def test_bad_base64_is_400(client, question):
    _, text = question
    error = error_of(client.post("/v1/chat/completions",
                                 json={"messages": image_message("data:image/png;base64,not*base64", text)}), 400)
    assert "base64" in error["message"] and error["param"] == "messages[0].content[0].image_url.url"


def test_oversized_image_is_422_with_the_limit_named(client, question, served):
    _, text = question
    before = metric(served, "edgeinfer_preflight_rejections_total", client.headers, reason="image_too_large")
    big = Image.new("RGB", (1100, 60), (10, 10, 10))
    error = error_of(client.post("/v1/chat/completions",
                                 json={"messages": image_message(data_uri(png_bytes(big)), text)}), 422)
    assert error["code"] == "image_too_large" and "1024" in error["message"]
    assert error["param"] == "messages[0].content[0]"
    after = metric(served, "edgeinfer_preflight_rejections_total", client.headers, reason="image_too_large")
    assert after == before + 1


def test_image_file_over_the_limit_is_413(client, question):
    _, text = question
    data = data_uri(os.urandom(1_300_000))  # under the 2 MiB body limit, over the 1 MiB file limit
    error = error_of(client.post("/v1/chat/completions", json={"messages": image_message(data, text)}), 413)
    assert error["code"] == "file_too_large"


def test_body_over_the_limit_is_413(client):
    error = error_of(client.post("/v1/chat/completions", content=b"x" * (3 * 2**20),
                                 headers={"content-type": "application/json"}), 413)
    assert "max_body_mb" in error["message"]


def test_n_over_1_and_unsupported_fields_are_refused_clearly(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert "n=2 is not supported" in error_of(client.post("/v1/chat/completions", json={**body, "n": 2}),
                                              400)["message"]
    assert error_of(client.post("/v1/chat/completions", json={**body, "logprobs": True}), 400)["param"] == "logprobs"
    assert error_of(client.post("/v1/chat/completions", json={**body, "tools": []}), 422)["param"] == "tools"
    assert error_of(client.post("/v1/chat/completions", json={**body, "model": "gpt-4o"}), 404)["code"] == \
        "model_not_found"


def test_remote_and_local_urls_are_refused_unless_allowed(client, question):
    _, text = question
    for url, flag in (("https://example.com/cat.png", "--allow-remote-images"),
                      ("file:///etc/hostname", "--allowed-local-dir")):
        error = error_of(client.post("/v1/chat/completions", json={"messages": image_message(url, text)}), 400)
        assert flag in error["message"]


def test_prompt_over_the_context_is_422(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}
    error = error_of(client.post("/v1/chat/completions", json=body), 422)
    assert "max_context_tokens" in error["message"]


def test_unknown_path_is_404_in_the_same_shape(client):
    error_of(client.get("/v1/nothing"), 404)


# --------------------------------------------------------------------------- load and faults


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory, question) -> Path:
    folder = tmp_path_factory.mktemp("images")
    (folder / "frame.png").write_bytes(png_bytes(question[0]))
    return folder


@pytest.fixture(scope="module")
def busy(model_dir, image_folder) -> Iterator[str]:
    """One engine slot and one queue place; remote and local images allowed."""
    profile = load_profile("cpu", [*BASE_OVERRIDES, "server.max_concurrent=1", "server.max_queue=1",
                                   "images.max_file_mb=1", "server.max_body_mb=2"])
    settings = ServerSettings(model_dir=model_dir, profile=profile, backend="torch", allow_remote_images=True,
                              remote_image_timeout_s=5, allowed_local_dir=image_folder)
    with running_server(settings) as url:
        yield url


def long_body(text: str = "tell me a story", stream: bool = True) -> dict:
    return {"messages": [{"role": "user", "content": text}], "stream": stream, **LONG}


def test_full_queue_is_503_with_retry_after_and_disconnects_free_blocks(busy):
    assert held_blocks(busy) == 0
    with httpx.Client(base_url=busy, timeout=60) as first:
        with first.stream("POST", "/v1/chat/completions", json=long_body()) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # admitted and streaming
            wait_for(lambda: held_blocks(busy) > 0, what="blocks in use")

            queued_headers = threading.Event()

            def queued_client() -> None:
                with httpx.Client(base_url=busy, timeout=60) as second:
                    with second.stream("POST", "/v1/chat/completions", json=long_body("another")) as response:
                        queued_headers.set()
                        next(response.iter_lines())  # then leave: the connection closes

            waiter = threading.Thread(target=queued_client, daemon=True)
            waiter.start()
            wait_for(lambda: metric(busy, "edgeinfer_queue_depth") == 1, what="one queued request")
            refused = httpx.post(f"{busy}/v1/chat/completions", json=long_body(stream=False), timeout=10)
            error = error_of(refused, 503)
            assert int(refused.headers["retry-after"]) >= 1 and error["code"] == "capacity_exceeded"
            assert not queued_headers.is_set()
        # The first stream is closed mid-generation: its blocks come back, the queued one runs.
        waiter.join(30)
    assert queued_headers.is_set()
    wait_for(lambda: held_blocks(busy) == 0, what="every block free")
    assert metric(busy, "edgeinfer_requests_running") == 0
    assert metric(busy, "edgeinfer_requests_total", endpoint="/v1/chat/completions", status="499") == 2
    assert metric(busy, "edgeinfer_request_finish_total") == 0  # neither ran to its end


def test_non_streaming_client_that_leaves_is_cancelled(busy):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{busy}/v1/chat/completions", json=long_body(stream=False), timeout=1.0)
    wait_for(lambda: held_blocks(busy) == 0, what="every block free")
    assert metric(busy, "edgeinfer_requests_running") == 0


def test_remote_and_local_images_when_allowed(busy, question, image_folder):
    image, text = question
    payload = png_bytes(image)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = payload if self.path == "/frame.png" else os.urandom(3 * 2**20)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    origin = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{origin.server_address[1]}"
        answers = []
        for url in (data_uri(payload), f"{base}/frame.png", f"file://{image_folder / 'frame.png'}"):
            response = httpx.post(f"{busy}/v1/chat/completions", timeout=60,
                                  json={"messages": image_message(url, text), "max_tokens": 6})
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["message"]["content"])
        assert answers[0] == answers[1] == answers[2]
        too_big = httpx.post(f"{busy}/v1/chat/completions", timeout=60,
                             json={"messages": image_message(f"{base}/huge.png", text)})
        assert error_of(too_big, 413)["code"] == "file_too_large"
        outside = httpx.post(f"{busy}/v1/chat/completions", timeout=60,
                             json={"messages": image_message("file:///etc/hostname", text)})
        assert "outside the allowed folder" in error_of(outside, 400)["message"]
    finally:
        origin.shutdown()


def test_sigterm_finishes_the_request_in_flight_and_exits_0(model_dir):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "edgeinfer.cli.main", "serve", "--model", str(model_dir), "--profile", "cpu",
               "--backend", "torch", "--port", str(port), "--log-level", "warning",
               *[arg for item in BASE_OVERRIDES for arg in ("--set", item)],
               "--set", "server.shutdown_grace_s=30"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "EDGEINFER_API_KEY": API_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process=process)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {**long_body(), "max_tokens": 400}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: _refused(url), timeout_s=10, what="the listener to close")
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert process.wait(timeout=30) == 0, process.stdout.read().decode()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


# --------------------------------------------------------------------------- the async engine


@pytest.fixture
def tiny_engine(checkpoint) -> Engine:
    """A fresh engine per test: an AsyncEngine owns its engine and closes it."""
    return Engine.load(checkpoint("smolvlm"), profile=load_profile("cpu", BASE_OVERRIDES), backend="torch")


def test_new_requests_join_the_running_batch(tiny_engine):
    forced = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = [tiny_engine.generate(text, [], forced).text for text in ("first question", "second one")]

    async def together():
        engine = AsyncEngine(tiny_engine, max_concurrent=2, max_queue=0).start()
        try:
            first = engine.submit(GenerationRequest("first question", (), forced))
            await first.admitted()
            pieces = []
            async for piece in first.deltas():
                pieces.append(piece)
                if len(pieces) == 5:  # the first is decoding: now the second arrives
                    second = asyncio.ensure_future(engine.generate(GenerationRequest("second one", (), forced)))
            return "".join(pieces), first.completion, await second
        finally:
            engine.close()

    steps_before = tiny_engine.counters["decode_steps"]
    text, first, second = asyncio.run(together())
    assert [text, second.result.text] == alone
    assert second.stats.ttft_s < first.stats.total_s  # its first token came while the first decoded
    # Shared decode steps: fewer steps than the two requests' tokens one after the other.
    assert tiny_engine.counters["decode_steps"] - steps_before < 2 * 39


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_burst_gets_first_tokens_one_after_another_with_the_tokens_of_each_alone(tiny_engine, ahead):
    """``ahead`` 1 is what an engine with a picture stream (on a GPU) allows: the next request enters
    while one prompt is pending, so its picture is encoded meanwhile; never two."""
    tiny_engine.prompts_ahead = ahead
    forced = SamplingParams(max_new_tokens=12, ignore_eos=True)
    pictures = [Image.new("RGB", (64, 48), color) for color in ("red", "green", "blue", "white", "black")]
    alone = [tiny_engine.generate("what is this?", [p], forced).token_ids for p in pictures]

    async def burst():
        engine = AsyncEngine(tiny_engine, max_concurrent=5, max_queue=0).start()
        try:
            handles = engine.submit_many([GenerationRequest("what is this?", (p,), forced) for p in pictures])
            done = [await h.result() for h in handles]
            return done, [h.seq.timings for h in handles]
        finally:
            engine.close()

    done, timings = asyncio.run(burst())
    assert [c.result.token_ids for c in done] == alone
    # Each request's prompt is prefilled before the picture of the one after the next (ahead 1) or
    # of the next (ahead 0), also when a decode step of the others runs between them.
    for done_first, later in zip(timings, timings[1 + ahead:]):
        assert done_first.first_token < later.created
    entered_early = [b.created < a.first_token for a, b in zip(timings, timings[1:])]
    assert any(entered_early) == bool(ahead), entered_early


def test_deadline_cancels_and_frees_blocks(tiny_engine):
    async def run():
        engine = AsyncEngine(tiny_engine, max_concurrent=1, max_queue=1).start()
        try:
            with pytest.raises(RequestTimedOut, match="deadline of 0.3 s"):
                await engine.generate(GenerationRequest("go", (), SamplingParams(max_new_tokens=3000,
                                                                                 ignore_eos=True), timeout_s=0.3))
        finally:
            engine.close()

    asyncio.run(run())
    assert tiny_engine.pool.num_free == tiny_engine.pool.num_blocks


def test_drain_finishes_in_flight_work_and_refuses_new(tiny_engine):
    async def run():
        engine = AsyncEngine(tiny_engine, max_concurrent=1, max_queue=1).start()
        try:
            running = asyncio.ensure_future(engine.generate(GenerationRequest(
                "go", (), SamplingParams(max_new_tokens=30, ignore_eos=True))))
            await asyncio.sleep(0.01)
            cancelled = await engine.drain(grace_s=30)
            with pytest.raises(ServerShuttingDown, match="shutting down"):
                engine.submit(GenerationRequest("late"))
            return cancelled, await running
        finally:
            engine.close()

    cancelled, completion = asyncio.run(run())
    assert cancelled == 0 and len(completion.result.token_ids) == 30


# --------------------------------------------------------------------------- settings


def test_settings_refuse_a_public_address_without_a_key(tmp_path):
    profile = load_profile("cpu")
    with pytest.raises(ServerSettingsError, match="without an API key"):
        ServerSettings(model_dir=tmp_path, profile=profile, host="0.0.0.0")
    with pytest.raises(ServerSettingsError, match="empty"):
        ServerSettings(model_dir=tmp_path, profile=profile, api_key=" ")
    assert ServerSettings(model_dir=tmp_path, profile=profile, host="0.0.0.0", api_key=API_KEY).host == "0.0.0.0"
    assert ServerSettings(model_dir=tmp_path, profile=profile, host="0.0.0.0", insecure_public=True)


def test_serve_command_refuses_a_public_address_without_a_key(tmp_path):
    from typer.testing import CliRunner

    from edgeinfer.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--profile", "cpu", "--host", "0.0.0.0"],
                                env={"EDGEINFER_API_KEY": None})
    assert result.exit_code == 2 and "without an API key" in result.output
