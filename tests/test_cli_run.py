"""`edgeinfer run` end to end through the real command: the bundled demo model, and a tiny checkpoint."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageOps

from tests.conftest import noise_image


def edgeinfer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeinfer.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env=env)


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
    load = report["timings"]["load"]
    assert set(load) == {"model_s", "engines_s", "engine_s", "capture_s"} and min(load.values()) >= 0
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


# --------------------------------------------------------------------------- the demo model

REPO = Path(__file__).resolve().parents[1]


def test_readme_first_command_answers_the_bundled_example():
    """The README's first command, as a user types it (the installed script where there is one)."""
    from edgeinfer.demo import synthetic

    command = [shutil.which("edgeinfer")] if shutil.which("edgeinfer") else [sys.executable, "-m", "edgeinfer.cli.main"]
    done = subprocess.run([*command, "run", "--image", "examples/demo.jpg", "What color is the circle?"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == synthetic.DEMO_QUESTIONS["What color is the circle?"] == "red"


def test_demo_model_answers_every_question_about_the_example():
    from edgeinfer.demo import synthetic

    for question, expected in synthetic.DEMO_QUESTIONS.items():
        done = edgeinfer("run", "--image", str(REPO / "examples" / "demo.jpg"), "--json", question)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["answer"].lower() == expected, question


def exif_rotated_photo(path: Path) -> Path:
    """Upright: a red circle top left. Stored turned a quarter turn anticlockwise, with EXIF
    orientation 6 (turn clockwise to show): read raw, the circle is bottom left."""
    upright = Image.new("RGB", (320, 240), (205, 212, 220))
    ImageDraw.Draw(upright).ellipse((40, 20, 120, 100), fill=(220, 30, 35))
    exif = Image.Exif()
    exif[0x0112] = 6
    upright.transpose(Image.Transpose.ROTATE_90).save(path, "JPEG", quality=95, exif=exif.tobytes())
    shown = ImageOps.exif_transpose(Image.open(path))
    assert shown.size == upright.size  # the picture above is what a viewer shows
    return path


def test_exif_rotated_photo_is_described_upright(tmp_path):
    photo = exif_rotated_photo(tmp_path / "rotated.jpg")
    done = edgeinfer("run", "--image", str(photo), "--json", "Is the circle at the top or the bottom?")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["answer"] == "top"
    assert report["preflight"][0]["original_size"] == [320, 240]
    raw = Image.open(io.BytesIO(photo.read_bytes()))  # the stored pixels, orientation not applied
    raw_path = tmp_path / "raw.png"
    raw.save(raw_path)
    assert json.loads(edgeinfer("run", "--image", str(raw_path), "--json",
                                "Is the circle at the top or the bottom?").stdout)["answer"] == "bottom"


def test_a_later_run_restores_the_prompt_from_the_disk_tier(tmp_path):
    """A four-block device pool from the command line; the second run of the same question
    finds the first run's blocks on disk and restores them rather than recomputing."""
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    args = ("run", "--image", str(REPO / "examples" / "demo.jpg"), "--profile", "cpu", "--set", "kv.device_blocks=4",
            "--set", "kv.block_size=32", "--json", "What color is the circle?")
    first, second = (json.loads(edgeinfer(*args, env=env).stdout) for _ in range(2))
    assert first["answer"] == second["answer"] == "red"
    assert first["cache"]["restored_blocks"] == 0 and first["cache"]["prefix_tokens_reused"] == 0
    assert second["cache"]["restored_blocks"] > 0 and second["cache"]["vision_reused"] == 1
    assert second["cache"]["prefix_tokens_reused"] == second["usage"]["prompt_tokens"] - 1
    assert second["token_ids"] == first["token_ids"]


# --------------------------------------------------------------------------- which backend runs


@pytest.fixture(scope="module")
def int8_build(tmp_path_factory):
    """The demo model's int8 ONNX Runtime build for the cpu profile, in an engines root of its own."""
    root = tmp_path_factory.mktemp("engines")
    done = edgeinfer("build", "--backend", "onnxruntime", "--precision", "int8", "--profile", "cpu",
                     "--engines", str(root), "--json")
    assert done.returncode == 0, done.stderr
    return root, Path(json.loads(done.stdout)["folder"])


def built_files(folder: Path) -> dict[str, int]:
    """Modification times of the build's graphs and manifest: a rebuild rewrites them all."""
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix in (".onnx", ".data", ".json")
            and not p.name.startswith(".")}


def ask_demo(root: Path, tmp_path: Path, *args: str) -> tuple[dict, str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # the disk tier stays in this test
    done = edgeinfer("run", "--engines", str(root), "--profile", "cpu", "--image", str(REPO / "examples" / "demo.jpg"),
                     "--max-tokens", "4", "--json", *args, "What color is the circle?", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


@pytest.mark.parametrize("backend", ["auto", "onnxruntime"])
def test_run_after_an_int8_build_uses_onnxruntime_int8_without_rebuilding(int8_build, tmp_path, backend):
    root, folder = int8_build
    before = built_files(folder)
    report, stderr = ask_demo(root, tmp_path, "--backend", backend)
    assert (report["backend"], report["precision"]) == ("onnxruntime", "int8")
    assert report["answer"] == "red" and report["stale_engines"] == []
    assert f"onnxruntime: {folder} (int8)" in stderr and "because" not in stderr
    assert built_files(folder) == before, "the int8 build must be reused, not rebuilt"


def test_auto_names_a_stale_build_with_its_rebuild_command_and_runs_torch(int8_build, tmp_path):
    root, folder = int8_build
    before = built_files(folder)
    # runtime.max_batch_size is one of the settings a build is made for: the build no longer fits.
    report, stderr = ask_demo(root, tmp_path, "--set", "runtime.max_batch_size=1")
    assert (report["backend"], report["precision"]) == ("torch", "fp32") and report["answer"] == "red"
    [note] = report["stale_engines"]
    assert note.startswith(f"{folder}: stale onnxruntime engines, not used (profile 'cpu' changed since the build)")
    assert note.endswith("rebuild: edgeinfer build --backend onnxruntime --model "
                         f"{Path(json.loads((folder / 'manifest.json').read_text())['model_dir'])} --profile cpu "
                         "--precision int8 --set runtime.max_batch_size=1")
    assert note in stderr
    assert built_files(folder) == before, "a stale build is named, never silently replaced"


def test_with_no_engines_built_run_answers_through_torch(tmp_path):
    report, _ = ask_demo(tmp_path / "no-engines", tmp_path)
    assert (report["backend"], report["precision"], report["stale_engines"]) == ("torch", "fp32", [])
    assert report["answer"] == "red"


def test_an_unknown_backend_is_refused_with_the_valid_names():
    done = edgeinfer("run", "--backend", "onnx", "what ?")
    assert done.returncode == 4 and "Traceback" not in done.stderr
    assert "unknown backend 'onnx'; choose one of: auto, torch, onnxruntime, tensorrt" in done.stderr


def test_one_question_captures_graphs_on_first_use_unless_told_otherwise():
    """``edgeinfer run`` answers one question: the profile's start-up captures (for a daemon) are
    off, the rest of the profile, and so what a built engine is checked against, as it was."""
    from edgeinfer.cli.run import one_question_profile
    from edgeinfer.profiles import load_profile, profile_fingerprint

    shipped = load_profile("cuda")
    assert shipped.runtime.capture_budget_s > 0
    one = one_question_profile("cuda", [])
    assert one.runtime.capture_budget_s == 0
    assert profile_fingerprint(one) == profile_fingerprint(shipped)
    assert replace(one, runtime=shipped.runtime) == shipped
    assert one_question_profile("cuda", ["runtime.capture_budget_s=30"]).runtime.capture_budget_s == 30
