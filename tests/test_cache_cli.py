"""``edgeinfer cache stats|clear|verify`` on a cache a real engine wrote, and the daemon's
``/admin/cache`` routes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from edgeinfer.cli.main import app
from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.kv.disk import DiskStore
from edgeinfer.kv.inventory import folder_layout, model_folders
from edgeinfer.profiles import load_profile
from edgeinfer.server import ServerSettings
from tests.test_server import (
    API_KEY,
    data_uri,
    image_message,
    png_bytes,
    running_server,
)

runner = CliRunner()
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def profile_for(cache: Path):
    return load_profile("cpu", ["kv.device_blocks=64", "memory.disk_tier_mb=64", f"kv.disk_dir={cache}"])


def fill(cache: Path) -> None:
    """Two questions about two pictures: KV blocks go through to disk, vision outputs too."""
    engine = Engine.load(DEMO_MODEL_DIR, profile=profile_for(cache), backend="torch")
    for picture in (synthetic.demo_picture(), synthetic.demo_picture().rotate(90)):
        engine.generate("What color is the circle?", [picture], SamplingParams(max_new_tokens=4))
    engine.close()


def cache_cmd(*args: str) -> dict:
    result = runner.invoke(app, ["cache", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def damage(cache: Path) -> None:
    """Flip bytes in one stored KV block and in one vision file."""
    folder = model_folders(cache)[0]
    layout = folder_layout(folder)
    store = DiskStore(cache, layout, (folder / "blocks.dat").stat().st_size // layout.nbytes)
    slot = min(store.records)
    store.close()
    with open(folder / "blocks.dat", "r+b") as f:
        f.seek(slot * layout.nbytes + 10)
        f.write(b"\xde\xad\xbe\xef")
    vision = sorted((folder / "vision").glob("*.emb"))[0]
    raw = bytearray(vision.read_bytes())
    raw[-3] ^= 0xFF
    vision.write_bytes(bytes(raw))


@pytest.fixture
def filled(tmp_path) -> Path:
    cache = tmp_path / "kv"
    fill(cache)
    return cache


def test_stats_says_what_the_cache_holds(filled):
    report = cache_cmd("stats", "--dir", str(filled))
    (folder,) = report["folders"]
    assert folder["kv_blocks"] > 0 and folder["kv_bytes"] > 0 and not folder["skipped"]
    assert folder["vision_entries"] == 2 and folder["fingerprint"]
    assert report["summary"].startswith(f"1 model folders, {folder['kv_blocks']} KV blocks")
    text = runner.invoke(app, ["cache", "stats", "--dir", str(filled)]).output
    assert "stats: 1 model folders" in text and folder["digest"][:12] in text


def test_verify_finds_and_removes_damaged_entries(filled):
    before = cache_cmd("stats", "--dir", str(filled))["totals"]
    assert cache_cmd("verify", "--dir", str(filled))["totals"]["damaged_blocks"] == 0
    damage(filled)
    report = cache_cmd("verify", "--dir", str(filled))
    assert report["totals"]["damaged_blocks"] == 1 and report["totals"]["damaged_vision"] == 1
    assert "1 damaged KV blocks and 1 damaged vision entries found and removed" in report["summary"]
    after = cache_cmd("stats", "--dir", str(filled))["totals"]
    assert after["kv_blocks"] == before["kv_blocks"] - 1 and after["vision_entries"] == before["vision_entries"] - 1
    assert cache_cmd("verify", "--dir", str(filled))["totals"]["damaged_blocks"] == 0  # nothing left to find


def test_clear_removes_what_it_is_asked_to_and_says_so(filled):
    before = cache_cmd("stats", "--dir", str(filled))["totals"]
    vision = cache_cmd("clear", "--vision", "--dir", str(filled))
    assert vision["totals"]["removed_vision"] == 2 and vision["totals"]["removed_blocks"] == 0
    assert cache_cmd("stats", "--dir", str(filled))["totals"]["kv_blocks"] == before["kv_blocks"]
    other = cache_cmd("clear", "--model", "ffffffffffff", "--dir", str(filled))
    assert other["folders"] == []  # no folder has that fingerprint
    everything = cache_cmd("clear", "--dir", str(filled))
    assert everything["totals"]["removed_blocks"] == before["kv_blocks"]
    assert everything["totals"]["freed_bytes"] > 0
    assert f"removed {before['kv_blocks']} KV blocks" in everything["summary"]
    after = cache_cmd("stats", "--dir", str(filled))["totals"]
    assert after["kv_blocks"] == 0 and after["kv_bytes"] == 0 and after["vision_entries"] == 0


def test_a_folder_an_engine_holds_is_left_alone(filled):
    engine = Engine.load(DEMO_MODEL_DIR, profile=profile_for(filled), backend="torch")
    try:
        (folder,) = cache_cmd("clear", "--dir", str(filled))["folders"]
        assert folder["skipped"].startswith("in use by a running engine") and folder["removed_blocks"] == 0
    finally:
        engine.close()
    assert cache_cmd("stats", "--dir", str(filled))["totals"]["kv_blocks"] > 0


def test_the_daemon_reports_verifies_and_clears_its_own_cache(tmp_path):
    cache = tmp_path / "kv"
    settings = ServerSettings(model_dir=DEMO_MODEL_DIR, profile=profile_for(cache), api_key=API_KEY,
                              backend="torch", model_name="demo")
    uri = data_uri(png_bytes(synthetic.demo_picture()))
    question = {"model": "demo", "messages": image_message(uri, "What color is the circle?"), "max_tokens": 4}
    with running_server(settings) as url, httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        assert httpx.get(f"{url}/admin/cache").status_code == 401
        assert client.post("/v1/chat/completions", json=question).status_code == 200
        live = client.get("/admin/cache").json()
        assert live["totals"]["vision_entries"] == 1 and not live["folders"][0]["skipped"]
        verified = client.post("/admin/cache/verify").json()
        assert verified["totals"]["damaged_blocks"] == 0 and verified["totals"]["kv_blocks"] > 0
        assert client.get("/is_sleeping").json()["is_sleeping"] is True  # it let go of the folder to check it
        cleared = client.post("/admin/cache/clear").json()
        assert cleared["totals"]["removed_blocks"] == verified["totals"]["kv_blocks"]
        answer = client.post("/v1/chat/completions", json=question)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"].strip() == "red"
