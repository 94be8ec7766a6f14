"""Hostile input at preflight and at the CLI: a patched JPEG header, a named pipe as an image,
a question that is not UTF-8, and a refused image that must not cost a model load."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from edgeinfer.errors import (
    InvalidParam,
    PreflightError,
    exit_code_for,
    http_status_for,
)
from edgeinfer.preflight import ImageRules, check_text, prepare_image, prepare_images
from tests.conftest import noise_image

RULES = ImageRules(max_side=2048, max_pixels=2048 * 2048, max_images=4, max_file_bytes=20 * 2**20)


def jpeg(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", **options)
    return out.getvalue()


def patched_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` with its frame header claiming ``width`` x ``height``."""
    at = data.index(b"\xff\xc0")
    return data[:at + 5] + struct.pack(">HH", height, width) + data[at + 9:]


# --- preflight ---------------------------------------------------------------------------------
@pytest.mark.parametrize("on_oversize", ["reject", "fit"])
def test_a_jpeg_header_patched_to_40000x30000_is_refused_with_the_pixel_limit(on_oversize):
    data = patched_size(jpeg(noise_image(64, 48)), 40000, 30000)
    with pytest.raises(PreflightError) as caught:
        prepare_image(data, RULES, on_oversize, "patched.jpg")
    error = caught.value
    assert (error.reason, error.measured, error.limit) == ("decompression_bomb", 40000 * 30000, RULES.decode_cap)
    assert "patched.jpg" in str(error) and exit_code_for(error) == 2


def test_a_jpeg_header_patched_under_the_cap_is_refused_as_truncated():
    data = patched_size(jpeg(noise_image(64, 48)), 2000, 1500)
    with pytest.raises(PreflightError) as caught:
        prepare_image(data, RULES, "fit", "patched.jpg")
    assert caught.value.reason == "truncated"


@pytest.mark.parametrize("options", [{}, {"progressive": True, "optimize": True}])
def test_a_large_flat_jpeg_still_fits(options):
    """The least data a real JPEG spends per 8x8 block is well above the bound preflight applies."""
    data = jpeg(Image.new("L", (6000, 4000), 128), **options)
    prepared = prepare_image(data, RULES, "fit", "flat.jpg")
    assert prepared.report.original_size == (6000, 4000) and max(prepared.image.size) == 2048


def _refused_within(source, seconds: float = 10.0) -> PreflightError:
    outcome: list[BaseException | None] = []

    def read():
        try:
            prepare_images([source], RULES)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome.append(error)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive() and os.path.exists(str(source)):
        os.close(os.open(str(source), os.O_WRONLY | os.O_NONBLOCK))  # give a blocked reader its end of file
        thread.join(5)
    assert outcome, f"reading {source} did not return within {seconds} s"
    assert isinstance(outcome[0], PreflightError), outcome[0]
    return outcome[0]


def test_a_named_pipe_with_no_writer_is_refused_at_once(tmp_path):
    fifo = tmp_path / "frame.jpg"
    os.mkfifo(fifo)
    error = _refused_within(fifo)
    assert error.reason == "unreadable" and error.measured == "a named pipe (FIFO)"


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), (".", "a directory")])
def test_other_non_regular_files_are_refused_by_kind(path, kind):
    error = _refused_within(path)
    assert error.reason == "unreadable" and error.measured == kind


@pytest.mark.parametrize("text, found", [("what is \ud800 this", "U+D800"),
                                         (b"caf\xe9 ?".decode("utf-8", "surrogateescape"), "byte 0xE9")])
def test_text_with_a_lone_surrogate_is_a_typed_error(text, found):
    with pytest.raises(InvalidParam) as caught:
        check_text(text, "question")
    error = caught.value
    assert found in error.message and error.param == "question"
    assert exit_code_for(error) == 2 and http_status_for(error) == 400
    assert check_text("un café ? 🙂", "question") == "un café ? 🙂"


# --- the CLI -------------------------------------------------------------------------------------
def edgeinfer(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "edgeinfer.cli.main", *args], capture_output=True, timeout=120,
                          env=env, check=False)


def test_a_named_pipe_as_image_is_a_json_error_with_json(tmp_path):
    fifo = tmp_path / "camera"
    os.mkfifo(fifo)
    done = edgeinfer("run", "--json", "--image", str(fifo), "what is it ?")
    assert done.returncode == 2, done.stderr[-2000:]
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "unreadable" and error["exit_code"] == 2 and "named pipe" in error["message"]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_non_utf8_question_is_exit_2_not_a_traceback(as_json):
    done = edgeinfer("run", *(["--json"] if as_json else []), os.fsdecode(b"caf\xe9 ?"))
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    if as_json:
        assert json.loads(done.stdout)["error"]["code"] == "invalid_request"
    else:
        assert b"not valid UTF-8" in done.stderr


def test_images_are_checked_before_the_model_loads(checkpoint, tmp_path):
    """A checkpoint without its weights: an image refusal must come before the model would fail to load."""
    model = tmp_path / "no-weights"
    shutil.copytree(checkpoint("smolvlm"), model, ignore=shutil.ignore_patterns("*.safetensors"))
    image = tmp_path / "wide.png"
    noise_image(480, 360).save(image)
    done = edgeinfer("run", "--model", str(model), "--profile", "cpu", "--set", "images.max_side=200",
                     "--image", str(image), "what ?")
    assert done.returncode == 2, done.stderr[-2000:]
    assert b"max_side" in done.stderr and b"Traceback" not in done.stderr
    ok = edgeinfer("run", "--model", str(model), "--profile", "cpu", "--image", str(image), "what ?")
    assert ok.returncode == 3  # the image passes, then the weights are missing: the model load fails
