"""Sleep, wake and idle release: the engine alone, then a real daemon on 127.0.0.1.

The daemon tests serve the bundled demo model, whose answers about the synthetic picture
are known, so "answered correctly after the wake" is checked against the right answer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.engine.engine import SleepLevel
from edgeinfer.errors import RequestError
from edgeinfer.profiles import load_profile
from edgeinfer.server import ServerSettings
from tests.test_server import (
    API_KEY,
    BASE_OVERRIDES,
    data_uri,
    image_message,
    metric,
    png_bytes,
    running_server,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = "What color is the circle?"
GREEDY = SamplingParams(max_new_tokens=12)


# --------------------------------------------------------------------------- the engine


@pytest.fixture
def demo_engine(tmp_path) -> Engine:
    profile = load_profile("cpu", ["kv.device_blocks=64", "memory.disk_tier_mb=64", f"kv.disk_dir={tmp_path}"])
    engine = Engine.load(DEMO_MODEL_DIR, profile=profile, backend="torch")
    yield engine
    engine.close()


@pytest.mark.parametrize("level", [1, 2])
def test_an_engine_asleep_answers_the_same_after_waking(demo_engine, level):
    picture = synthetic.demo_picture()
    before = demo_engine.generate(QUESTION, [picture], GREEDY)
    assert before.text.strip().lower() == "red"
    steps = demo_engine.counters["decode_steps"]

    report = demo_engine.sleep(level)
    assert demo_engine.is_sleeping and demo_engine.sleep_level == level
    assert report.freed_kv_bytes > 0 and report.persisted_blocks >= 0
    assert report.weights == ("host-file" if level == 1 else "dropped")
    assert demo_engine.pool is None and demo_engine.kv is None  # nothing holds the pool any more
    assert demo_engine.counters["decode_steps"] == steps  # counted across the sleep

    after = demo_engine.generate(QUESTION, [picture], GREEDY)
    assert not demo_engine.is_sleeping
    assert after.token_ids == before.token_ids
    assert after.timings["wake_s"] > 0 and before.timings["wake_s"] == 0
    # The prefix cache went to the disk tier on the way down and is found again after the wake.
    assert after.cache["prefix_tokens_reused"] > 0
    assert demo_engine.sleep_stats.wakes == 1 and demo_engine.sleep_stats.sleeps[level] == 1


def test_sleep_deepens_and_a_level_is_checked(demo_engine):
    demo_engine.sleep(1)
    assert demo_engine.sleep(1).weights == "unchanged"
    assert demo_engine.sleep(2).weights == "dropped" and demo_engine.sleep_level == SleepLevel.DISCARD
    assert demo_engine.wake_up() > 0 and demo_engine.wake_up() == 0.0
    with pytest.raises(RequestError, match="1 .* or 2"):
        demo_engine.sleep(3)


def test_sleep_is_refused_while_a_request_is_in_the_engine(demo_engine):
    seq = demo_engine.submit(QUESTION, [synthetic.demo_picture()], GREEDY)
    with pytest.raises(RequestError, match="1 requests in the engine"):
        demo_engine.sleep(1)
    demo_engine.cancel(seq)
    demo_engine.result(seq)
    demo_engine.sleep(1)


def test_level_2_needs_an_engine_loaded_from_a_folder(demo_engine):
    bare = Engine(demo_engine.model, demo_engine.config, demo_engine.engines)
    with pytest.raises(RequestError, match="not loaded from a folder"):
        bare.sleep(2)
    bare.close()


# --------------------------------------------------------------------------- the daemon


def rss() -> int:
    return psutil.Process().memory_info().rss


def ask(client: httpx.Client, max_tokens: int = 12) -> dict:
    uri = data_uri(png_bytes(synthetic.demo_picture()))
    response = client.post("/v1/chat/completions", json={
        "model": "demo", "messages": image_message(uri, QUESTION), "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def answer(body: dict) -> str:
    return body["choices"][0]["message"]["content"].strip().lower()


def test_daemon_sleep_frees_at_least_half_of_what_loading_added():
    # The cpu profile as shipped: its KV pool alone is 1 GiB.
    profile = load_profile("cpu", ["memory.disk_tier_mb=0"])
    base = rss()
    with running_server(ServerSettings(model_dir=DEMO_MODEL_DIR, profile=profile, api_key=API_KEY,
                                       backend="torch", model_name="demo")) as url, httpx.Client(base_url=url, headers=AUTH,
                                                                             timeout=120) as client:
        assert client.post("/sleep").status_code == 200  # asleep before any request
        assert client.post("/wake_up").json()["is_sleeping"] is False
        assert answer(ask(client)) == "red"
        loaded = rss()
        added = loaded - base
        # The pool is in memory (zeroed), not just reserved. (Memory the test process freed since
        # `base` was taken can offset a little of it, hence 0.9.)
        assert added > 0.9 * 2**30

        for level in (1, 2):
            slept = client.post(f"/sleep?level={level}")
            assert slept.status_code == 200, slept.text
            assert slept.json()["level"] == level and slept.json()["freed_kv_bytes"] >= 2**30
            assert client.get("/is_sleeping").json() == {"is_sleeping": True, "level": level}
            assert loaded - rss() >= added / 2, f"level {level}: RSS fell {(loaded - rss()) / 2**20:.0f} MiB " \
                                                f"of {added / 2**20:.0f} MiB"
            assert httpx.get(f"{url}/health").json()["sleeping"] is True
            body = ask(client)  # wakes it
            assert answer(body) == "red" and body["edgeinfer"]["timings"]["wake_s"] > 0
            assert client.get("/is_sleeping").json()["is_sleeping"] is False

        client.post("/sleep?level=1")
        woke = client.post("/wake_up").json()
        assert woke["is_sleeping"] is False and woke["seconds"] > 0
        assert metric(url, "edgeinfer_sleeps_total", AUTH, level="1") == 3  # before the first request, in the loop, then once more
        assert metric(url, "edgeinfer_sleeps_total", AUTH, level="2") == 1
        assert metric(url, "edgeinfer_wakes_total", AUTH) == 4
        assert metric(url, "edgeinfer_wake_seconds_total", AUTH) > 0


def test_sleep_needs_the_key_and_a_valid_level(checkpoint):
    profile = load_profile("cpu", BASE_OVERRIDES)
    with running_server(ServerSettings(model_dir=checkpoint("smolvlm"), profile=profile, api_key=API_KEY,
                                       backend="torch", model_name="demo")) as url:
        assert httpx.post(f"{url}/sleep").status_code == 401
        assert httpx.get(f"{url}/is_sleeping").status_code == 401
        assert httpx.post(f"{url}/sleep?level=3", headers=AUTH).status_code == 422
        assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json()["is_sleeping"] is False


def test_idle_release_sleeps_after_idle_sleep_s_and_a_request_wakes_it():
    profile = load_profile("cpu", [*BASE_OVERRIDES, "server.idle_sleep_s=0.5", "server.idle_sleep_level=2"])
    with running_server(ServerSettings(model_dir=DEMO_MODEL_DIR, profile=profile, api_key=API_KEY,
                                       backend="torch", model_name="demo")) as url, httpx.Client(base_url=url, headers=AUTH,
                                                                             timeout=120) as client:
        assert answer(ask(client)) == "red"
        deadline = time.monotonic() + 20
        while not client.get("/is_sleeping").json()["is_sleeping"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get("/is_sleeping").json() == {"is_sleeping": True, "level": 2}
        assert metric(url, "edgeinfer_sleep_level", AUTH) == 2
        body = ask(client)
        assert answer(body) == "red" and body["edgeinfer"]["timings"]["wake_s"] > 0
        assert metric(url, "edgeinfer_sleeps_total", AUTH, level="2") >= 1


def test_fifty_sleep_wake_cycles_under_load_fail_no_request(checkpoint):
    profile = load_profile("cpu", [*BASE_OVERRIDES, "server.max_concurrent=2", "server.max_queue=8"])
    stop = threading.Event()
    statuses: list[int] = []

    def load(url: str) -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            while not stop.is_set():
                response = client.post("/v1/chat/completions", json={
                    "model": "demo", "messages": [{"role": "user", "content": "say something"}],
                    "max_tokens": 4, "temperature": 0})
                statuses.append(response.status_code)

    with running_server(ServerSettings(model_dir=checkpoint("smolvlm"), profile=profile, api_key=API_KEY,
                                       backend="torch", model_name="demo")) as url, httpx.Client(base_url=url, headers=AUTH,
                                                                             timeout=120) as admin:
        with ThreadPoolExecutor(3) as pool:
            clients = [pool.submit(load, url) for _ in range(3)]
            for cycle in range(50):
                level = 2 if cycle % 10 == 9 else 1
                assert admin.post(f"/sleep?level={level}").status_code == 200
                if cycle % 2:
                    assert admin.post("/wake_up").status_code == 200
                else:  # a request wakes it; the next sleep must find it awake, or it would be a no-op
                    deadline = time.monotonic() + 60
                    while admin.get("/is_sleeping").json()["is_sleeping"] and time.monotonic() < deadline:
                        time.sleep(0.01)
                time.sleep(0.02)
            stop.set()
            for future in clients:
                future.result()
        assert statuses and set(statuses) == {200}, f"{len(statuses)} requests: {sorted(set(statuses))}"
        assert metric(url, "edgeinfer_sleeps_total", AUTH) == 50
        assert metric(url, "edgeinfer_requests_total", AUTH, endpoint="/v1/chat/completions", status="200") \
            == len(statuses)


def test_bench_sleep_writes_its_raw_file_at_tiny_size(checkpoint, tmp_path):
    """The GPU benchmark's code paths, on the CPU with a tiny Qwen2-VL checkpoint."""
    import json

    from typer.testing import CliRunner

    from edgeinfer.cli.main import app

    result = CliRunner().invoke(app, ["bench", "sleep", "--model", str(checkpoint("qwen2_vl")), "--profile", "cpu",
                                      "--set", "kv.device_blocks=64", "--set", "memory.disk_tier_mb=0",
                                      "--image-size", "64x64", "--repeats", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(next(tmp_path.glob("sleep-cpu-*.json")).read_text())
    assert report["benchmark"] == "sleep" and [r["level"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:
        assert run["weights"] == ("host-file" if run["level"] == 1 else "dropped")
        assert 0 < run["wake_s"] < run["wake_to_first_token_s"]
        assert run["asleep"]["rss"] < run["awake"]["rss"]
        # Where the time went: the result's own timings, and nothing compiled again after a wake.
        question = run["question"]
        assert question["timings"]["wake_s"] == run["wake_s"] and question["timings"]["prefill_s"] > 0
        assert question["cache"]["prefix_tokens_reused"] >= 0 and question["built"]["dynamo_graphs"] == 0
    assert set(report["summary"]) == {"1", "2"}
    summary = next(tmp_path.glob("sleep-cpu-*.md")).read_text()
    assert "| level 1 #0 |" in summary and "| after load, again |" in summary and "prefill s" in summary
