"""`edgeinfer run` end to end through the real command, on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import noise_image


def edgeinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeinfer.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "frame.png"
    noise_image(480, 360, seed=3).save(path)
    return path


def test_json_report_has_answer_timings_usage_preflight_and_cache(checkpoint, image_file):
    done = edgeinfer("run", "--model", str(checkpoint("smolvlm")), "--profile", "cpu", "--image", str(image_file),
                     "--max-tokens", "6", "--json", "what is in the image ?")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["token_ids"]) == report["usage"]["completion_tokens"] <= 6
    assert report["usage"]["image_tokens"] > 0 and report["finish_reason"] in ("stop", "length")
    assert {"preflight_s", "vision_s", "prefill_s", "ttft_s", "total_s"} <= set(report["timings"])
    assert report["preflight"][0]["original_size"] == [480, 360] and report["preflight"][0]["action"] == "none"
    assert "prefix_tokens_reused" in report["cache"] and report["backend"] == "torch" and report["profile"] == "cpu"


def test_oversized_image_is_exit_2_with_one_line_naming_the_limit(checkpoint, image_file):
    done = edgeinfer("run", "--model", str(checkpoint("smolvlm")), "--profile", "cpu", "--set", "images.max_side=200",
                     "--image", str(image_file), "what ?")
    assert done.returncode == 2
    assert "max_side" in done.stderr and "200" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_fit_reports_the_original_and_new_size(checkpoint, image_file):
    done = edgeinfer("run", "--model", str(checkpoint("smolvlm")), "--profile", "cpu", "--set", "images.max_side=200",
                     "--on-oversize", "fit", "--image", str(image_file), "--max-tokens", "2", "--json", "what ?")
    assert done.returncode == 0, done.stderr
    preflight = json.loads(done.stdout)["preflight"][0]
    assert preflight["original_size"] == [480, 360] and preflight["final_size"] == [200, 150]
    assert preflight["action"] == "downscaled"


def test_missing_backend_is_named_not_a_silent_fallback(checkpoint):
    done = edgeinfer("run", "--model", str(checkpoint("smolvlm")), "--backend", "tensorrt", "what ?")
    assert done.returncode == 4 and "tensorrt" in done.stderr and "Traceback" not in done.stderr
