"""Preflight against a corpus of real bad and awkward image files, generated at tiny size."""

from __future__ import annotations

import gc
import io
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from edgeinfer.errors import (
    FileTooLargeError,
    MemoryPressureError,
    PreflightError,
    exit_code_for,
    http_status_for,
)
from edgeinfer.preflight import (
    CostEstimate,
    ImageRules,
    OnOversize,
    check_cost,
    estimate_cost,
    fit_size,
    prepare_image,
    prepare_images,
    read_image_source,
)
from edgeinfer.profiles import ImageLimits

MIB = 1024 * 1024
RULES = ImageRules(max_side=1536, max_pixels=1536 * 1536, max_images=4, max_file_bytes=20 * MIB)
RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload)
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width x height`` RGB with a tiny IDAT: no big allocation."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


def webp_vp8x_header(width: int, height: int) -> bytes:
    """A WebP extended header claiming a ``width x height`` canvas, followed by nothing."""
    canvas = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    vp8x = bytes([0x10, 0, 0, 0]) + canvas
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def exif_rotated_jpeg() -> bytes:
    """40x20 stored, red block top-left; EXIF orientation 6 (shown turned 90 degrees clockwise)."""
    image = Image.new("RGB", (40, 20), BLUE)
    image.paste(RED, (0, 0, 8, 8))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(image, "JPEG", quality=95, exif=exif.tobytes())


def palette_with_transparency() -> bytes:
    image = Image.new("P", (8, 8), 1)
    image.putpalette([0, 0, 0, *RED] + [0] * (256 - 2) * 3)
    image.paste(0, (0, 0, 4, 8))  # left half: index 0, transparent
    return encode(image, "PNG", transparency=0)


def sixteen_bit_png() -> bytes:
    values = np.array([[0, 1000, 32896, 65535]], dtype=np.uint16)
    return encode(Image.fromarray(values), "PNG")


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (16, 12), color) for color in (RED, GREEN, BLUE)]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("corpus")
    photo_png = encode(noise(120, 90), "PNG")
    photo_jpg = encode(noise(120, 90), "JPEG")
    files = {
        "empty.png": b"",
        "truncated.png": photo_png[: len(photo_png) // 2],
        "truncated.jpg": photo_jpg[: len(photo_jpg) // 2],
        "notes.png": b"shopping list\n- milk\n- eggs\n",
        "huge_header.png": png_header_only(30000, 30000),
        "huge_canvas.webp": webp_vp8x_header(16383, 16383),
        "strip.png": encode(Image.new("RGB", (1, 20000), RED), "PNG"),
        "wide_strip.png": encode(Image.new("RGB", (40, 20000), RED), "PNG"),
        "cmyk.jpg": encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95),
        "sixteen.png": sixteen_bit_png(),
        "palette_alpha.png": palette_with_transparency(),
        "rotated.jpg": exif_rotated_jpeg(),
        "animated.gif": animated_gif(),
        "drawing.svg": b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" '
                       b'width="10" height="10"><rect width="10" height="10"/></svg>\n',
        "photo.heic": b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 64,
        "doc.pdf": b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n",
        "photo.jpg": encode(noise(2000, 1500), "JPEG", quality=80),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


def prepare_file(path: Path, rules: ImageRules = RULES, on_oversize: str = "reject"):
    data, name = read_image_source(path, rules.max_file_bytes)
    return prepare_image(data, rules, OnOversize(on_oversize), name=name)


def rejection(path: Path, rules: ImageRules = RULES, on_oversize: str = "reject") -> PreflightError:
    with pytest.raises(PreflightError) as caught:
        prepare_file(path, rules, on_oversize)
    return caught.value


# ------------------------------------------------------------------ the bad-image corpus


@pytest.mark.parametrize("name, reason, measured", [
    ("empty.png", "empty", 0),
    ("truncated.png", "truncated", None),
    ("truncated.jpg", "truncated", None),
    ("notes.png", "unsupported_format", "text (named as PNG)"),
    ("drawing.svg", "unsupported_format", "SVG"),
    ("photo.heic", "unsupported_format", "HEIC"),
    ("doc.pdf", "unsupported_format", "PDF"),
])
@pytest.mark.parametrize("on_oversize", ["reject", "fit"])
def test_bad_file_meets_its_typed_error(corpus, name, reason, measured, on_oversize):
    error = rejection(corpus[name], on_oversize=on_oversize)
    assert error.reason == reason
    if measured is not None:
        assert error.measured == measured
    assert exit_code_for(error) == 2 and http_status_for(error) == 422
    assert "\n" not in str(error) and name in str(error) and reason in str(error)


@pytest.mark.parametrize("name, pixels", [("huge_header.png", 30000 * 30000),
                                          ("huge_canvas.webp", 16383 * 16383)])
@pytest.mark.parametrize("on_oversize", ["reject", "fit"])
def test_huge_header_is_refused_without_decoding(corpus, name, pixels, on_oversize):
    gc.collect()
    before = psutil.Process().memory_info().rss
    error = rejection(corpus[name], on_oversize=on_oversize)
    grown = psutil.Process().memory_info().rss - before
    print(f"{name} ({on_oversize}): RSS grew {grown / MIB:.2f} MiB")
    assert error.reason == "decompression_bomb"
    assert error.measured == pixels and error.limit == RULES.decode_cap
    assert error.override == f"--set images.max_pixels={-(-pixels // 4)}"
    assert grown < 50 * MIB, f"RSS grew {grown / MIB:.1f} MiB"


def test_strip_over_max_side_is_rejected_naming_the_limit(corpus):
    error = rejection(corpus["strip.png"])
    assert (error.reason, error.measured, error.limit) == ("image_too_large", 20000, 1536)
    assert error.override == "--on-oversize fit or --set images.max_side=20000"
    assert str(error) == (f"{corpus['strip.png']}: image_too_large: long side in px (max_side) "
                          "is 20000, limit 1536; override: --on-oversize fit or "
                          "--set images.max_side=20000")


def test_strip_fits_to_max_side_keeping_one_pixel_width(corpus):
    prepared = prepare_file(corpus["strip.png"], on_oversize="fit")
    assert prepared.image.size == (1, 1536)
    assert prepared.report.original_size == (1, 20000)
    assert prepared.report.action == "downscaled"
    assert prepared.image.getpixel((0, 700)) == RED


def test_strip_under_the_model_minimum_is_rejected_even_with_fit(corpus):
    rules = ImageRules.from_profile(_profile(), model_min_side=28)
    error = rejection(corpus["strip.png"], rules, on_oversize="fit")
    assert (error.reason, error.measured, error.limit) == ("image_too_small", 1, 28)
    assert error.override is None


def test_fitted_strip_falling_under_min_side_is_rejected_naming_min_side(corpus):
    rules = ImageRules.from_profile(_profile(), model_min_side=28)
    error = rejection(corpus["wide_strip.png"], rules, on_oversize="fit")
    assert (error.reason, error.measured, error.limit) == ("image_too_small", 3, 28)
    assert "after fitting" in str(error) and "min_side" in str(error)


def test_cmyk_jpeg_becomes_rgb(corpus):
    prepared = prepare_file(corpus["cmyk.jpg"])
    assert prepared.image.mode == "RGB"
    assert prepared.report.conversions == ("CMYK->RGB",)
    red, green, blue = prepared.image.getpixel((8, 8))
    assert red > 240 and green < 15 and blue < 15


def test_sixteen_bit_png_is_scaled_not_clipped(corpus):
    prepared = prepare_file(corpus["sixteen.png"])
    assert prepared.report.conversions == ("I;16->RGB (16-bit scaled to 8-bit)",)
    assert [prepared.image.getpixel((x, 0))[0] for x in range(4)] == [0, 4, 128, 255]


def test_palette_transparency_is_composited_on_white(corpus):
    prepared = prepare_file(corpus["palette_alpha.png"])
    assert prepared.report.conversions == (
        "P+transparency->RGB (transparent pixels composited on white)",)
    assert prepared.image.getpixel((1, 1)) == WHITE
    assert prepared.image.getpixel((6, 1)) == RED


def test_exif_rotation_is_applied_and_limits_see_the_upright_size(corpus):
    prepared = prepare_file(corpus["rotated.jpg"])
    assert prepared.image.size == (20, 40)
    assert prepared.report.original_size == (20, 40)
    assert prepared.report.conversions == ("exif_transpose(orientation=6)",)
    red, _, blue = prepared.image.getpixel((16, 3))  # top-left block turned to top-right
    assert red > 200 and blue < 60


def test_exif_rotated_image_fits_in_upright_orientation(corpus):
    rules = ImageRules(max_side=20, max_pixels=400, max_images=1, max_file_bytes=MIB)
    prepared = prepare_file(corpus["rotated.jpg"], rules, on_oversize="fit")
    assert prepared.report.original_size == (20, 40)
    assert prepared.image.size == prepared.report.final_size == (10, 20)


def test_animated_gif_keeps_the_first_frame_and_says_so(corpus):
    prepared = prepare_file(corpus["animated.gif"])
    assert prepared.image.getpixel((5, 5)) == RED
    assert "first_frame (animated or multi-page)" in prepared.report.conversions


# ------------------------------------------------------------------ accepted formats


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF"])
def test_each_accepted_format_decodes_to_rgb(fmt):
    prepared = prepare_image(encode(noise(32, 24), fmt), RULES, name=f"x.{fmt.lower()}")
    assert prepared.image.mode == "RGB" and prepared.image.size == (32, 24)
    assert prepared.report.format == fmt and prepared.report.action == "none"


@pytest.mark.parametrize("mode, note", [
    ("LA", "LA->RGB (alpha composited on white)"),
    ("RGBA", "RGBA->RGB (alpha composited on white)"),
    ("1", "1->RGB"),
    ("L", "L->RGB"),
])
def test_mode_conversions_are_reported(mode, note):
    prepared = prepare_image(encode(Image.new(mode, (6, 4)), "PNG"), RULES)
    assert prepared.image.mode == "RGB" and prepared.report.conversions == (note,)


def test_format_comes_from_the_bytes_not_the_name(corpus):
    data = encode(noise(8, 8), "JPEG")
    assert prepare_image(data, RULES, name="mislabelled.png").report.format == "JPEG"


def test_content_hash_depends_on_pixels_not_on_the_file_format():
    image = noise(16, 16)
    as_png = prepare_image(encode(image, "PNG"), RULES)
    as_bmp = prepare_image(encode(image, "BMP"), RULES)
    other = prepare_image(encode(noise(16, 16, seed=1), "PNG"), RULES)
    assert as_png.sha256 == as_bmp.sha256 != other.sha256


# ------------------------------------------------------------------ reject vs fit


def test_fit_reports_original_and_new_size_in_text_and_json(corpus):
    rules = ImageRules(max_side=512, max_pixels=4 * MIB, max_images=1, max_file_bytes=20 * MIB)
    prepared = prepare_file(corpus["photo.jpg"], rules, on_oversize="fit")
    report = prepared.report
    assert (report.original_size, report.final_size) == ((2000, 1500), (512, 384))
    assert prepared.image.size == (512, 384)
    assert report.describe() == (f"{corpus['photo.jpg']}: JPEG 2000x1500 -> 512x384 (downscaled "
                                 "to fit max_side=512); converted: jpeg_decoded_at_1/2_scale")
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["original_size"] == [2000, 1500] and as_json["final_size"] == [512, 384]
    assert as_json["action"] == "downscaled" and as_json["fitted_to"] == "max_side=512"


def test_fit_honours_max_pixels_as_well_as_max_side():
    rules = ImageRules(max_side=1000, max_pixels=100 * 100, max_images=1, max_file_bytes=MIB)
    prepared = prepare_image(encode(noise(300, 200), "PNG"), rules, "fit")
    width, height = prepared.image.size
    assert width * height <= 100 * 100 and abs(width / height - 1.5) < 0.02
    assert prepared.report.fitted_to == "max_pixels=10000"


def test_reject_over_max_pixels_names_it():
    rules = ImageRules(max_side=1000, max_pixels=100 * 100, max_images=1, max_file_bytes=MIB)
    with pytest.raises(PreflightError) as caught:
        prepare_image(encode(noise(300, 200), "PNG"), rules)
    assert (caught.value.reason, caught.value.measured, caught.value.limit) == (
        "image_too_large", 60000, 10000)
    assert caught.value.override == "--on-oversize fit or --set images.max_pixels=60000"


def test_limit_set_by_the_model_is_not_offered_as_a_profile_override():
    rules = ImageRules.from_profile(_profile(), model_max_side=64)
    with pytest.raises(PreflightError) as caught:
        prepare_image(encode(noise(100, 10), "PNG"), rules)
    assert caught.value.limit == 64
    assert caught.value.override == "--on-oversize fit (the model's processor sets max_side)"


def test_fit_size_examples():
    assert fit_size((4032, 3024), 1536, 1536 * 1536) == (1536, 1152)
    assert fit_size((3024, 4032), 1536, 1536 * 1536) == (1152, 1536)
    assert fit_size((1, 20000), 1536, 100) == (1, 100)
    assert fit_size((640, 480), 1536, 1536 * 1536) == (640, 480)


# ------------------------------------------------------------------ reading sources


def test_file_over_the_byte_cap_is_refused_from_stat_alone(tmp_path):
    sparse = tmp_path / "big.jpg"
    with open(sparse, "wb") as handle:
        handle.truncate(4 * 1024 * MIB)  # 4 GiB of holes: reading it would take seconds
    with pytest.raises(FileTooLargeError) as caught:
        read_image_source(sparse, 20 * MIB)
    error = caught.value
    assert (error.reason, error.measured, error.limit) == (
        "file_too_large", 4 * 1024 * MIB, 20 * MIB)
    assert error.override == "--set images.max_file_mb=4096"
    assert http_status_for(error) == 413 and exit_code_for(error) == 2


def test_stream_over_the_byte_cap_stops_one_byte_past_it():
    stream = io.BytesIO(b"\xff" * 5000)
    with pytest.raises(FileTooLargeError) as caught:
        read_image_source(stream, 1000)
    assert caught.value.measured == 1001 and stream.tell() == 1001


def test_stdin_is_read_for_dash(monkeypatch):
    data = encode(noise(8, 8), "PNG")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert read_image_source("-", MIB) == (data, "stdin")


def test_missing_file_is_a_typed_error(tmp_path):
    with pytest.raises(PreflightError) as caught:
        read_image_source(tmp_path / "nope.png", MIB)
    assert caught.value.reason == "unreadable" and exit_code_for(caught.value) == 2


def test_image_count_is_checked_before_any_file_is_read(tmp_path):
    missing = [tmp_path / f"{index}.png" for index in range(5)]
    with pytest.raises(PreflightError) as caught:
        prepare_images(missing, RULES)
    assert (caught.value.reason, caught.value.measured, caught.value.limit) == (
        "too_many_images", 5, 4)
    assert caught.value.override == "--set images.max_images=5"


def test_prepare_images_names_raw_bytes_by_position(corpus):
    images = prepare_images([encode(noise(8, 8), "PNG"), corpus["cmyk.jpg"]], RULES)
    assert [image.report.source for image in images] == ["image[0]", str(corpus["cmyk.jpg"])]


# ------------------------------------------------------------------ rules and choices


def _profile() -> ImageLimits:
    return ImageLimits(max_side=1536, max_pixels=1536 * 1536, max_images=4, max_file_mb=20)


def test_rules_take_the_stricter_of_profile_and_model():
    rules = ImageRules.from_profile(_profile(), model_max_side=1024, model_max_pixels=10**8,
                                    model_min_side=28)
    assert (rules.max_side, rules.max_pixels, rules.min_side) == (1024, 1536 * 1536, 28)
    assert rules.model_limited == frozenset({"max_side"})
    assert rules.max_file_bytes == 20 * MIB and rules.max_images == 4


def test_rules_refuse_impossible_limits():
    with pytest.raises(ValueError, match="min_side"):
        ImageRules(max_side=10, max_pixels=100, max_images=1, max_file_bytes=1, min_side=28)


def test_on_oversize_lists_the_valid_choices():
    with pytest.raises(ValueError, match="reject, fit"):
        OnOversize("shrink")


# ------------------------------------------------------------------ request cost


def test_cost_formula():
    cost = estimate_cost(256, 40, 100, vision_hidden=1280, vision_layers_tokens_per_image=1024,
                         kv_bytes_per_token=28672, dtype_bytes=2)
    assert cost.vision_activation_bytes == 1024 * 1280 * 2 * 12
    assert cost.kv_bytes == (256 + 40 + 100) * 28672
    assert cost.total_bytes == cost.vision_activation_bytes + cost.kv_bytes


def test_cost_over_the_budget_is_refused():
    cost = CostEstimate(vision_tokens=10, vision_activation_bytes=600, kv_bytes=500,
                        total_bytes=1100)
    with pytest.raises(PreflightError) as caught:
        check_cost(cost, budget_bytes=1000, available_floor_bytes=0)
    error = caught.value
    assert (error.reason, error.measured, error.limit) == ("memory", 1100, 1000)
    assert http_status_for(caught.value) == 422


def test_cost_that_would_breach_the_memory_floor_is_refused_for_now():
    cost = CostEstimate(vision_tokens=1, vision_activation_bytes=1, kv_bytes=1, total_bytes=2)
    floor = psutil.virtual_memory().total  # more than can ever be available
    with pytest.raises(MemoryPressureError) as caught:
        check_cost(cost, budget_bytes=10**6, available_floor_bytes=floor)
    assert caught.value.reason == "memory" and http_status_for(caught.value) == 503


def test_cost_within_budget_and_floor_passes():
    cost = CostEstimate(vision_tokens=1, vision_activation_bytes=1, kv_bytes=1, total_bytes=2)
    check_cost(cost, budget_bytes=10**6, available_floor_bytes=0)


@pytest.mark.parametrize("failure, reason", [
    (EOFError("no more data"), "truncated"),
    (struct.error("unpack requires a buffer of 4 bytes"), "truncated"),
    (zlib.error("invalid distance too far back"), "truncated"),
    (KeyError(17), "truncated"),
    (Image.DecompressionBombError("frame too big"), "decompression_bomb"),
    (Image.DecompressionBombWarning("frame big"), "decompression_bomb"),
    (MemoryError(), "memory"),
])
def test_every_decoder_failure_becomes_a_preflight_error(failure, reason):
    from edgeinfer.preflight import _decoding

    # bytes without the PNG end marker, so a generic failure reads as "truncated"
    with pytest.raises(PreflightError) as caught:
        with _decoding(b"\x89PNG\r\n\x1a\n\x00\x00", "PNG", "cut.png"):
            raise failure
    assert caught.value.reason == reason and caught.value.source == "cut.png"
