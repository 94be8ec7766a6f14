"""Power- and heat-aware admission: a fake sysfs tree says the board is at its limit, the
daemon admits less and asks clients to come back later; removing the limit restores it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from edgeinfer.demo import DEMO_MODEL_DIR
from edgeinfer.power import limits_reached, read_power_snapshot
from edgeinfer.profiles import load_profile
from edgeinfer.server import ServerSettings
from tests.fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, write
from tests.test_server import API_KEY, BASE_OVERRIDES, metric, running_server

ORIN_NX = JETSON_BOARDS[3]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GPU_CAP = "/sys/class/devfreq/17000000.gpu/max_freq"


def jetson(root: Path, **kwargs) -> Path:
    """A fake Orin NX whose power modes also set the GPU clock cap, as nvpmodel.conf does."""
    Jetson(ORIN_NX, **kwargs).build(root)
    caps = {"MAXN": -1, "10W": 612000000, "15W": 918000000, "25W": 1020000000}
    conf = "< PM_CONFIG DEFAULT=2 >\n\n" + "".join(
        f"< POWER_MODEL ID={i} NAME={name} >\nCPU_ONLINE CORE_0 1\nGPU MIN_FREQ 0\nGPU MAX_FREQ {caps[name]}\n\n"
        for i, name in ORIN_NX.modes)
    write(root, "/etc/nvpmodel.conf", conf)
    return root


def reached(root: Path, **limits) -> tuple[str, ...]:
    return limits_reached(read_power_snapshot(root, use_jtop=False), **limits)


def test_a_cool_board_under_its_budget_is_at_no_limit(tmp_path):
    root = jetson(tmp_path, mode=3)  # 25W: GPU cap 1020 MHz, and the devfreq cap says 1020 MHz
    assert reached(root, thermal_zone="tj", thermal_limit_c=95, power_budget_w=25, clock_cap_check=True) == ()


def test_each_limit_is_named_with_its_reading(tmp_path):
    hot = {"cpu-thermal": 60_000, "tj-thermal": 96_500}
    root = jetson(tmp_path, mode=3, thermal=hot)
    assert reached(root, thermal_zone="tj", thermal_limit_c=95) == ("tj-thermal at 96.5 C, limit 95 C",)
    assert reached(root, thermal_zone="gpu", thermal_limit_c=95) == ()  # another zone's limit
    assert reached(root, power_budget_w=6.5) == ("board input 7.0 W, budget 6.5 W",)  # VDD_IN 5 V x 1.4 A
    write(root, GPU_CAP, "612000000\n")  # the kernel lowered the cap under the mode's
    assert reached(root, clock_cap_check=True) == ("GPU clock cap 612 MHz, under mode 25W's 1020 MHz",)
    assert reached(root, clock_cap_check=False) == ()


def test_maxn_sets_no_cap_to_fall_under(tmp_path):
    root = jetson(tmp_path, mode=0)
    write(root, GPU_CAP, "306000000\n")
    assert read_power_snapshot(root, use_jtop=False).mode.gpu_max_hz is None
    assert reached(root, clock_cap_check=True) == ()


def test_profile_power_limits_are_checked():
    from edgeinfer.errors import ProfileError

    with pytest.raises(ProfileError, match="power.throttled_max_concurrent"):
        load_profile("cpu", ["power.thermal_limit_c=90", "power.throttled_max_concurrent=5"])  # over 2
    with pytest.raises(ProfileError, match="power.retry_factor"):
        load_profile("cpu", ["power.retry_factor=0.5"])
    assert load_profile("orin-nano-8gb").power.enabled and not load_profile("cpu").power.enabled


# --------------------------------------------------------------------------- the daemon


def wait_until(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


LONG = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000,
        "ignore_eos": True, "stream": True}


def _queued(url: str) -> None:
    """A streaming request that waits in the queue; it leaves once admitted."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG) as response:
            next(response.iter_lines())


def overload_retry_after(url: str, running: int, queued: int) -> int:
    """Fill ``running`` engine slots with long streams and ``queued`` queue places, then send one
    more request: its Retry-After."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        streams = [client.stream("POST", "/v1/chat/completions", json=LONG) for _ in range(running)]
        waiters = [threading.Thread(target=_queued, args=(url,), daemon=True) for _ in range(queued)]
        lines = []  # kept: a dropped line iterator may close its stream
        try:
            for stream in streams:
                lines.append(stream.__enter__().iter_lines())
                assert next(lines[-1]).startswith("data: ")  # admitted and generating
            for waiter in waiters:
                waiter.start()
            wait_until(lambda: metric(url, "edgeinfer_queue_depth", AUTH) == queued, "the queue to fill")
            refused = client.post("/v1/chat/completions", json={**LONG, "stream": False})
            assert refused.status_code == 503, refused.text
            return int(refused.headers["retry-after"])
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
            for waiter in waiters:
                waiter.join(30)


def test_heat_lowers_batch_and_queue_and_stretches_retry_after_then_recovers(tmp_path):
    root = make_cpu(tmp_path / "board")
    zone = "/sys/class/thermal/thermal_zone0"
    write(root, f"{zone}/type", "cpu-thermal\n")
    write(root, f"{zone}/temp", "50000\n")
    profile = load_profile("cpu", [*BASE_OVERRIDES, "server.max_concurrent=2", "server.max_queue=1",
                                   "power.thermal_zone=cpu", "power.thermal_limit_c=90", "power.check_every_s=0.1",
                                   "power.throttled_max_concurrent=1", "power.throttled_max_queue=0",
                                   "power.retry_factor=4"])
    settings = ServerSettings(model_dir=DEMO_MODEL_DIR, profile=profile, api_key=API_KEY, backend="torch",
                              model_name="tiny", board_root=root)
    with running_server(settings) as url:
        health = lambda: httpx.get(f"{url}/health").json()
        assert health()["throttled"] is False
        assert metric(url, "edgeinfer_admission_max_concurrent", AUTH) == 2
        cool_retry = overload_retry_after(url, running=2, queued=1)

        write(root, f"{zone}/temp", "93000\n")
        wait_until(lambda: health()["throttled"], "the daemon to see the heat")
        assert health()["throttle_reasons"] == ["cpu-thermal at 93.0 C, limit 90 C"]
        assert metric(url, "edgeinfer_throttled", AUTH) == 1
        assert metric(url, "edgeinfer_admission_max_concurrent", AUTH) == 1
        hot_retry = overload_retry_after(url, running=1, queued=0)  # one running request is enough now
        assert hot_retry >= 4 and hot_retry > cool_retry

        write(root, f"{zone}/temp", "60000\n")
        wait_until(lambda: not health()["throttled"], "the daemon to see the board cool down")
        assert metric(url, "edgeinfer_throttled", AUTH) == 0
        assert metric(url, "edgeinfer_admission_max_concurrent", AUTH) == 2
        assert overload_retry_after(url, running=2, queued=1) < hot_retry
