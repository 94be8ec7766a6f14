"""Property tests: whatever bytes arrive, preflight returns a valid image or a PreflightError."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from edgeinfer.errors import PreflightError
from edgeinfer.preflight import ImageRules, OnOversize, PreparedImage, fit_size, prepare_image

# Small limits and a small decode cap, so that a mutated header claiming a big image is
# refused (or decoded) quickly.
RULES = ImageRules(max_side=48, max_pixels=48 * 36, max_images=1, max_file_bytes=64 * 1024,
                   decode_floor_pixels=256 * 256)
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _seeds() -> list[bytes]:
    rng = np.random.default_rng(7)
    photo = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    frames = [Image.new("RGB", (20, 10), color) for color in ((255, 0, 0), (0, 0, 255))]
    return [
        _encode(photo, "PNG"),
        _encode(photo.convert("P"), "PNG", transparency=3),
        _encode(photo.convert("LA"), "PNG"),
        _encode(Image.fromarray((rng.integers(0, 65536, (12, 16))).astype(np.uint16)), "PNG"),
        _encode(photo, "JPEG", quality=70),
        _encode(photo, "JPEG", quality=70, progressive=True, exif=exif.tobytes()),
        _encode(photo.convert("CMYK"), "JPEG"),
        _encode(photo, "WEBP", quality=60),
        _encode(photo, "WEBP", lossless=True),
        _encode(photo, "BMP"),
        _encode(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        _encode(photo, "TIFF"),
        _encode(photo, "TIFF", compression="tiff_lzw"),
        _encode(Image.new("RGB", (200, 4)), "PNG"),
    ]


SEEDS = _seeds()
MAGICS = [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"II*\x00", b"MM\x00*", b"BM",
          b"RIFF\x00\x00\x00\x00WEBPVP8X", b"<svg", b""]


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        position = draw(st.integers(0, len(data) - 1))
        operation = draw(st.sampled_from(["flip", "set", "cut", "insert", "drop"]))
        if operation == "flip":
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif operation == "set":
            data[position] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01]))
        elif operation == "cut":
            del data[position:]
        elif operation == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[position:position + draw(st.integers(1, 64))]
        if not data:
            break
    return bytes(data)


def _prepare_or_refuse(data: bytes, on_oversize: OnOversize) -> None:
    try:
        prepared = prepare_image(data, RULES, on_oversize, name="fuzz")
    except PreflightError as error:
        assert error.reason and "\n" not in str(error)
        return
    _assert_within_rules(prepared)


def _assert_within_rules(prepared: PreparedImage) -> None:
    width, height = prepared.image.size
    assert prepared.image.mode == "RGB"
    assert max(width, height) <= RULES.max_side and width * height <= RULES.max_pixels
    assert min(width, height) >= RULES.min_side
    assert prepared.report.final_size == (width, height) and len(prepared.sha256) == 64


@pytest.mark.filterwarnings("error")  # a Pillow warning escalated to an error is still refused
@FUZZ
@given(data=st.binary(max_size=1024), on_oversize=st.sampled_from(list(OnOversize)))
def test_random_bytes_only_ever_raise_preflight_error(data, on_oversize):
    _prepare_or_refuse(data, on_oversize)


@pytest.mark.filterwarnings("error")
@FUZZ
@given(magic=st.sampled_from(MAGICS), tail=st.binary(max_size=512),
       on_oversize=st.sampled_from(list(OnOversize)))
def test_random_bytes_behind_a_magic_only_ever_raise_preflight_error(magic, tail, on_oversize):
    _prepare_or_refuse(magic + tail, on_oversize)


@pytest.mark.filterwarnings("error")
@settings(FUZZ, max_examples=250)
@given(data=mutated_images(), on_oversize=st.sampled_from(list(OnOversize)))
def test_mutated_images_only_ever_raise_preflight_error(data, on_oversize):
    _prepare_or_refuse(data, on_oversize)


@pytest.mark.parametrize("seed", range(len(SEEDS)))
def test_every_unmutated_seed_is_accepted_with_fit(seed):
    _assert_within_rules(prepare_image(SEEDS[seed], RULES, OnOversize.FIT))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(width=st.integers(1, 40000), height=st.integers(1, 40000),
       max_side=st.integers(1, 5000), max_pixels=st.integers(1, 10**7))
def test_fit_size_stays_within_both_limits_and_keeps_the_aspect_ratio(width, height, max_side,
                                                                     max_pixels):
    new_width, new_height = fit_size((width, height), max_side, max_pixels)
    assert 1 <= new_width <= width and 1 <= new_height <= height
    assert max(new_width, new_height) <= max_side and new_width * new_height <= max_pixels
    if new_width > 1 and new_height > 1:  # a side clamped at 1 px cannot keep the ratio
        assert abs(new_width / new_height - width / height) <= (width / height) * (
            1 / new_width + 1 / new_height) + 1e-9
    if max(width, height) <= max_side and width * height <= max_pixels:
        assert (new_width, new_height) == (width, height)
