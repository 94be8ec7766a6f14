"""Preflight: decode and check every image before anything is scheduled.

One image goes through four stages, each of which can only raise ``PreflightError``:

1. bytes: only a regular file (or stdin, ``-``) is read, never a named pipe or a device
   (which could block forever); its size is capped before it is read whole
   (``read_image_source``);
2. sniff: the leading bytes name the format; only JPEG, PNG, WebP, BMP, GIF and TIFF are
   handed to Pillow, everything else is refused by the name of what it is;
3. header: the image size is read without decoding pixels and compared with the
   decompression-bomb cap and the request's limits (a JPEG whose data is too short for
   the size its header claims is refused here: a decoder would fill the rest with
   grey); ``reject`` stops here, ``fit`` computes the downscaled size;
4. decode: pixels are decoded (a JPEG at a reduced scale when fitting), turned upright
   from EXIF orientation, converted to RGB and downscaled.

Every change to the pixels is listed in the ``ImageReport``: nothing is resized or
converted silently. ``docs/preflight.md`` lists the formats, conversions and reasons.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import stat
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import BinaryIO, Literal, Protocol

import numpy as np
import psutil
from PIL import Image, ImageFile, ImageOps

from edgeinfer.errors import FileTooLargeError, InvalidParam, MemoryPressureError, PreflightError

# Pillow's format name -> the name users know. MPO is a JPEG with extra pictures.
ALLOWED_FORMATS: dict[str, str] = {
    "JPEG": "JPEG", "MPO": "JPEG", "PNG": "PNG", "WEBP": "WebP",
    "BMP": "BMP", "GIF": "GIF", "TIFF": "TIFF",
}
ACCEPTED = "JPEG, PNG, WebP, BMP, GIF, TIFF"

# The decode cap is BOMB_FACTOR x max_pixels, but never below a 24-megapixel camera
# frame, so that `fit` can always decode an ordinary photo or screenshot.
BOMB_FACTOR = 4
DECODE_FLOOR_PIXELS = 6000 * 4000
JPEG_SMALLEST_SCALE = 8  # libjpeg decodes at 1/2, 1/4 or 1/8 scale directly
_MIB = 1024 * 1024
_READ_CHUNK = _MIB
_ORIENTATION_TAG = 0x0112
_INTEGER_GRAY_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})

ImageSource = str | os.PathLike[str] | bytes | bytearray | memoryview | BinaryIO


class ImageLimitsLike(Protocol):
    """The profile's image limits, as ``ImageRules.from_profile`` reads them."""

    max_side: int
    max_pixels: int
    max_images: int
    max_file_mb: float


class OnOversize(str, Enum):
    """What happens to an image over ``max_side`` or ``max_pixels``."""

    REJECT = "reject"
    FIT = "fit"

    @classmethod
    def _missing_(cls, value: object) -> OnOversize:
        valid = ", ".join(member.value for member in cls)
        raise ValueError(f"on_oversize must be one of {valid}; got {value!r}")


@dataclass(frozen=True, slots=True)
class ImageRules:
    """The limits that apply to one request: the stricter of the profile's and the model's.

    ``model_limited`` names the limits that the model's processor set (so no profile
    override lifts them). ``decode_floor_pixels`` is the least the decode cap can be.
    """

    max_side: int
    max_pixels: int
    max_images: int
    max_file_bytes: int
    min_side: int = 1
    model_limited: frozenset[str] = frozenset()
    decode_floor_pixels: int = DECODE_FLOOR_PIXELS

    def __post_init__(self) -> None:
        for name in ("max_side", "max_pixels", "max_file_bytes", "min_side", "decode_floor_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageRules.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_images < 0:
            raise ValueError(f"ImageRules.max_images must be >= 0, got {self.max_images}")
        if self.min_side > self.max_side or self.min_side * self.min_side > self.max_pixels:
            raise ValueError(
                f"ImageRules.min_side={self.min_side} leaves no allowed size under "
                f"max_side={self.max_side}, max_pixels={self.max_pixels}"
            )

    @property
    def decode_cap(self) -> int:
        """The most pixels preflight will decode for one image (the bomb guard)."""
        return max(BOMB_FACTOR * self.max_pixels, self.decode_floor_pixels)

    @classmethod
    def from_profile(cls, images: ImageLimitsLike, model_max_side: int | None = None,
                     model_max_pixels: int | None = None,
                     model_min_side: int | None = None) -> ImageRules:
        """``images`` has ``max_side``, ``max_pixels``, ``max_images``, ``max_file_mb`` (MiB)."""
        max_side, side_by_model = _stricter(images.max_side, model_max_side)
        max_pixels, pixels_by_model = _stricter(images.max_pixels, model_max_pixels)
        limited = {name for name, by_model in
                   (("max_side", side_by_model), ("max_pixels", pixels_by_model)) if by_model}
        return cls(max_side=max_side, max_pixels=max_pixels, max_images=images.max_images,
                   max_file_bytes=int(images.max_file_mb * _MIB),
                   min_side=model_min_side or 1, model_limited=frozenset(limited))


def _stricter(profile_value: int, model_value: int | None) -> tuple[int, bool]:
    if model_value is not None and model_value < profile_value:
        return model_value, True
    return profile_value, False


@dataclass(frozen=True, slots=True)
class ImageReport:
    """What preflight did to one image; sizes are width x height of the upright image."""

    source: str
    format: str
    original_size: tuple[int, int]
    final_size: tuple[int, int]
    action: Literal["none", "downscaled"]
    conversions: tuple[str, ...]
    fitted_to: str | None = None  # e.g. "max_side=1536"; set when action is "downscaled"

    def describe(self) -> str:
        size = _wxh(self.original_size)
        if self.action == "downscaled":
            size += f" -> {_wxh(self.final_size)} (downscaled to fit {self.fitted_to})"
        else:
            size += ", unchanged size"
        converted = f"; converted: {', '.join(self.conversions)}" if self.conversions else ""
        return f"{self.source}: {self.format} {size}{converted}"

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "format": self.format,
                "original_size": list(self.original_size), "final_size": list(self.final_size),
                "action": self.action, "conversions": list(self.conversions),
                "fitted_to": self.fitted_to}


@dataclass(frozen=True, slots=True)
class PreparedImage:
    image: Image.Image  # RGB, upright, within the rules
    report: ImageReport
    sha256: str  # of the final size and RGB pixels: the image's content key


def _wxh(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


# ---------------------------------------------------------------- stage 1: bytes


def read_image_source(source: ImageSource, max_file_bytes: int, *,
                      name: str | None = None) -> tuple[bytes, str]:
    """Return ``(data, display name)`` from a path, ``"-"`` (stdin), bytes or a binary stream.

    The byte cap holds before the whole file is read: a path is checked with ``stat``
    first, and every read stops one byte past the cap.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        display = name or "image"
        _check_file_bytes(len(data), max_file_bytes, display, exact=True)
        return data, display
    if isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and source == "-":
            return _read_bounded(sys.stdin.buffer, max_file_bytes, name or "stdin"), name or "stdin"
        return _read_path(os.fspath(source), max_file_bytes, name or os.fspath(source))
    if hasattr(source, "read"):
        display = name or str(getattr(source, "name", "stream"))
        return _read_bounded(source, max_file_bytes, display), display
    raise TypeError(f"an image source is a path, '-', bytes or a binary stream, "
                    f"not {type(source).__name__}")


def _read_path(path: str, max_file_bytes: int, display: str) -> tuple[bytes, str]:
    try:
        # O_NONBLOCK: opening a named pipe with no writer returns at once instead of waiting for one.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise PreflightError("unreadable", exc.strerror or type(exc).__name__,
                             "a readable image file", what="file", source=display) from exc
    info = os.fstat(fd)  # of what was opened, not of a name that may have changed since
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise PreflightError("unreadable", _file_kind(info.st_mode), "a regular file ('-' reads stdin)",
                             what="file type", source=display)
    with open(fd, "rb") as stream:
        _check_file_bytes(info.st_size, max_file_bytes, display, exact=True)
        try:
            return _read_bounded(stream, max_file_bytes, display), display
        except OSError as exc:
            raise PreflightError("unreadable", exc.strerror or type(exc).__name__,
                                 "a readable image file", what="file", source=display) from exc


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _read_bounded(stream: BinaryIO, max_file_bytes: int, display: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total <= max_file_bytes:
        chunk = stream.read(min(_READ_CHUNK, max_file_bytes + 1 - total))
        if not chunk:
            break
        if not isinstance(chunk, (bytes, bytearray)):
            raise TypeError(f"{display}: an image stream must be binary, "
                            f"it gave {type(chunk).__name__}")
        chunks.append(bytes(chunk))
        total += len(chunk)
    _check_file_bytes(total, max_file_bytes, display, exact=False)
    return b"".join(chunks)


def _check_file_bytes(size: int, max_file_bytes: int, display: str, *, exact: bool) -> None:
    if size <= max_file_bytes:
        return
    what = "file size in bytes" if exact else "file size in bytes (at least)"
    needed_mb = math.ceil(size / _MIB)
    raise FileTooLargeError("file_too_large", size, max_file_bytes,
                            f"--set images.max_file_mb={needed_mb}", what=what, source=display)


# ---------------------------------------------------------------- stage 2: sniff

_MAGIC: tuple[tuple[tuple[bytes, ...], str], ...] = (
    ((b"\x89PNG\r\n\x1a\n",), "PNG"),
    ((b"\xff\xd8\xff",), "JPEG"),
    ((b"GIF87a", b"GIF89a"), "GIF"),
    ((b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"), "TIFF"),
    ((b"BM",), "BMP"),
)
# Formats that are recognised only to be refused by name.
_KNOWN_OTHERS: tuple[tuple[bytes, str], ...] = (
    (b"%PDF", "PDF"), (b"%!PS", "PostScript"), (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"8BPS", "PSD"), (b"qoif", "QOI"), (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x02\x00", "CUR"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"), (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"), (b"\x1f\x8b", "gzip (SVGZ?)"),
    (b"PK\x03\x04", "ZIP"), (b"DDS ", "DDS"), (b"#?RADIANCE", "HDR"),
)
_HEIF_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"heim": "HEIC", b"heis": "HEIC",
                b"hevc": "HEIC", b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF",
                b"avis": "AVIF"}
_IMAGE_SUFFIXES = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WebP",
                   ".bmp": "BMP", ".gif": "GIF", ".tif": "TIFF", ".tiff": "TIFF"}
_NOT_TEXT = bytes(b for b in range(32) if b not in b"\t\n\r\f\b") + b"\x7f"
_TEXT = bytes(range(256)).translate(None, _NOT_TEXT)


def sniff_format(data: bytes, name: str = "image") -> str:
    """Return the Pillow name of an accepted format, or raise naming what the data is."""
    if not data:
        raise PreflightError("empty", 0, "at least 1", what="file size in bytes", source=name)
    for prefixes, fmt in _MAGIC:
        if data.startswith(prefixes):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    detected = detect_other_format(data)
    claimed = _IMAGE_SUFFIXES.get(os.path.splitext(name)[1].lower())
    if claimed:
        detected += f" (named as {claimed})"
    raise PreflightError("unsupported_format", detected, ACCEPTED,
                         what="detected format", source=name)


def detect_other_format(data: bytes) -> str:
    """Name data that is not an accepted image, as precisely as its first bytes allow."""
    for prefix, fmt in _KNOWN_OTHERS:
        if data.startswith(prefix):
            return fmt
    if data[4:8] == b"ftyp":
        return _HEIF_BRANDS.get(data[8:12], "ISO media (MP4/MOV)")
    if data[:4] == b"RIFF":
        return f"RIFF {data[8:12].decode('latin-1').strip() or 'container'}"
    if data[:1] == b"P" and data[1:2] in (b"1", b"2", b"3", b"4", b"5", b"6", b"7"):
        return "PNM (PBM/PGM/PPM)"
    return _text_kind(data[:4096]) or "unrecognised binary data"


def _text_kind(head: bytes) -> str | None:
    if head.translate(None, _TEXT):
        return None  # control bytes left: binary
    lowered = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if b"<svg" in lowered:
        return "SVG"
    if lowered.startswith(b"<!doctype html") or b"<html" in lowered:
        return "HTML"
    if lowered.startswith(b"<?xml"):
        return "XML"
    return "text"


def _looks_like_text(data: bytes) -> bool:
    return _text_kind(data[:4096]) is not None


# ---------------------------------------------------------------- stage 3: header


def _open_lazy(data: bytes, fmt: str) -> ImageFile.ImageFile:
    """Open ``data`` as ``fmt`` reading only the header.

    The format's opener is called directly rather than through ``Image.open``: that one
    applies Pillow's process-wide ``MAX_IMAGE_PIXELS`` before the size is known to us.
    Preflight applies its own per-request cap to the header size instead, and changes no
    module-wide setting.
    """
    Image.init()
    factory, accept = Image.OPEN[fmt]
    accepted = True if accept is None else accept(data[:16])
    if isinstance(accepted, str) or not accepted:  # a str says why Pillow cannot open it
        raise SyntaxError(accepted or f"not a {fmt} file")
    image = factory(io.BytesIO(data), "")
    if image.format not in ALLOWED_FORMATS:
        raise SyntaxError(f"{fmt} opener returned {image.format}")
    return image


def webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """The canvas size from a WebP header, or None if the header is unreadable.

    Read here because Pillow's WebP opener allocates the canvas as it opens.
    """
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        return (int.from_bytes(data[24:27], "little") + 1,
                int.from_bytes(data[27:30], "little") + 1)
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        return (int.from_bytes(data[26:28], "little") & 0x3FFF,
                int.from_bytes(data[28:30], "little") & 0x3FFF)
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _header_size(data: bytes, fmt: str, name: str) -> tuple[int, int]:
    if fmt == "WEBP":
        size = webp_canvas_size(data)
    else:
        with _decoding(data, fmt, name):
            size = _open_lazy(data, fmt).size
    if size is None or min(size) < 1:
        raise PreflightError("corrupt", "unreadable" if size is None else _wxh(size),
                             "a header with a size of at least 1x1",
                             what=f"{ALLOWED_FORMATS[fmt]} header size", source=name)
    return size


def pixels_to_decode(fmt: str, size: tuple[int, int]) -> int:
    """The fewest pixels a decode of this image can produce.

    A JPEG can be decoded at 1/8 scale, and `fit` asks for the smallest scale that still
    covers the target, so its decode is bounded by max(this, 4 x target) <= decode cap.
    """
    width, height = size
    if ALLOWED_FORMATS.get(fmt) == "JPEG":
        step = JPEG_SMALLEST_SCALE
        return -(-width // step) * -(-height // step)
    return width * height


# Frame markers of arithmetic-coded JPEGs: they can spend less than a bit on a flat block.
_JPEG_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xDA)})  # TEM, RSTn, SOI, EOI


def jpeg_frame_marker(data: bytes) -> int | None:
    """The SOFn marker (0xC0..0xCF) of a JPEG stream, or None when none comes before the data ends."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker
        elif marker in _JPEG_NO_LENGTH:
            i += 2
        else:
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def jpeg_pixels_held(data: bytes) -> int | None:
    """The most pixels a Huffman-coded JPEG of ``len(data)`` bytes can describe, or None (arithmetic
    coding, or no frame header found: no bound).

    Every 8x8 block of every component costs at least one Huffman code of one bit (a
    progressive JPEG's first DC scan; a baseline one spends two), so the bytes bound the blocks.
    """
    marker = jpeg_frame_marker(data)
    if marker is None or marker in _JPEG_ARITHMETIC:
        return None
    return len(data) * 8 * 64


def _check_jpeg_data(data: bytes, fmt: str, size: tuple[int, int], rules: ImageRules, name: str) -> None:
    """A JPEG header that claims more pixels than its data can hold (a patched or cut-short file) is
    refused: decoders fill the missing part with grey rather than fail."""
    if ALLOWED_FORMATS.get(fmt) != "JPEG":
        return
    held, pixels = jpeg_pixels_held(data), size[0] * size[1]
    if held is None or pixels <= held:
        return
    if pixels > rules.decode_cap:
        raise PreflightError("decompression_bomb", pixels, rules.decode_cap, None,
                             what=f"pixels in the JPEG header (its {len(data)} bytes hold at most {held}; "
                                  f"cap: {BOMB_FACTOR} x max_pixels, at least {rules.decode_floor_pixels})",
                             source=name)
    raise PreflightError("truncated", len(data), f"at least {-(-pixels // (8 * 64))} bytes for "
                         f"{_wxh(size)} pixels", what="JPEG data in bytes", source=name)


def _check_decode_cap(pixels: int, rules: ImageRules, name: str) -> None:
    if pixels <= rules.decode_cap:
        return
    raise PreflightError(
        "decompression_bomb", pixels, rules.decode_cap,
        f"--set images.max_pixels={math.ceil(pixels / BOMB_FACTOR)}",
        what=f"pixels to decode (cap: {BOMB_FACTOR} x max_pixels, at least "
             f"{rules.decode_floor_pixels})", source=name)


def _check_min_side(size: tuple[int, int], rules: ImageRules, name: str, *,
                    after_fit: bool = False) -> None:
    if min(size) >= rules.min_side:
        return
    what = ("short side in px after fitting to max_side/max_pixels" if after_fit
            else "short side in px") + " (min_side, the model's minimum)"
    raise PreflightError("image_too_small", min(size), rules.min_side, None,
                         what=what, source=name)


def _limits_exceeded(size: tuple[int, int], rules: ImageRules) -> list[tuple[str, int, int]]:
    """``(limit name, measured, limit)`` for each size limit the image is over."""
    over = []
    if max(size) > rules.max_side:
        over.append(("max_side", max(size), rules.max_side))
    if size[0] * size[1] > rules.max_pixels:
        over.append(("max_pixels", size[0] * size[1], rules.max_pixels))
    return over


def _size_override(rules: ImageRules, limit_name: str, measured: int) -> str:
    if limit_name in rules.model_limited:
        return f"--on-oversize fit (the model's processor sets {limit_name})"
    return f"--on-oversize fit or --set images.{limit_name}={measured}"


def fit_size(size: tuple[int, int], max_side: int, max_pixels: int) -> tuple[int, int]:
    """The largest size with the same aspect ratio (to the pixel) within both limits.

    Never larger than ``size`` on either side, never below 1 px. Integer arithmetic, so
    the limits hold exactly.
    """
    width, height = size
    long, short = max(width, height), min(width, height)
    new_long = min(long, max_side, max_pixels, math.isqrt(max_pixels * long // short))
    while new_long > 1 and new_long * _scaled(short, new_long, long) > max_pixels:
        new_long -= 1
    new_short = _scaled(short, new_long, long)
    return (new_long, new_short) if width >= height else (new_short, new_long)


def _scaled(short: int, new_long: int, long: int) -> int:
    return max(1, (2 * short * new_long + long) // (2 * long))  # rounded, at least 1


def _target_size(size: tuple[int, int], rules: ImageRules, on_oversize: OnOversize,
                 name: str) -> tuple[tuple[int, int], str | None]:
    """The size to produce, and which limits it was fitted to (None when unchanged)."""
    over = _limits_exceeded(size, rules)
    if not over:
        return size, None
    if on_oversize is OnOversize.REJECT:
        limit_name, measured, limit = over[0]
        what = "long side in px (max_side)" if limit_name == "max_side" else "pixels (max_pixels)"
        raise PreflightError("image_too_large", measured, limit,
                             _size_override(rules, limit_name, measured), what=what, source=name)
    target = fit_size(size, rules.max_side, rules.max_pixels)
    _check_min_side(target, rules, name, after_fit=True)
    return target, ", ".join(f"{limit_name}={limit}" for limit_name, _, limit in over)


# ---------------------------------------------------------------- stage 4: decode


@contextmanager
def _decoding(data: bytes, fmt: str, name: str) -> Iterator[None]:
    """Turn any failure inside Pillow into a ``PreflightError``.

    Untrusted bytes reach C decoders and Python parsers that raise OSError, SyntaxError,
    EOFError, ValueError, struct.error, zlib.error, IndexError, KeyError, TypeError and
    more; which one depends on where the data went wrong, so every one is the file's fault.
    """
    try:
        yield
    except PreflightError:
        raise
    except MemoryError as exc:
        raise MemoryPressureError("memory", "more than is free", psutil.virtual_memory().available,
                                  "retry when memory is free", what="bytes to decode the image",
                                  source=name) from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        limit = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else "Pillow's limit"
        raise PreflightError("decompression_bomb", "over Pillow's limit", limit, None,
                             what="pixels in a frame or tile", source=name) from exc
    except Exception as exc:
        raise _decode_error(exc, data, fmt, name) from exc


def _decode_error(exc: Exception, data: bytes, fmt: str, name: str) -> PreflightError:
    if _looks_like_text(data):
        return PreflightError("unsupported_format", "text", ACCEPTED,
                              what=f"detected format (starts like {fmt})", source=name)
    detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
    reason = "truncated" if _is_truncated(exc, data, fmt) else "corrupt"
    display = ALLOWED_FORMATS.get(fmt, fmt)
    return PreflightError(reason, len(data), f"a complete {display} stream ({detail})",
                          what=f"{display} data in bytes", source=name)


def _is_truncated(exc: Exception, data: bytes, fmt: str) -> bool:
    if isinstance(exc, EOFError) or "truncated" in str(exc).lower():
        return True
    if fmt == "PNG":
        return b"IEND" not in data
    if fmt == "JPEG":
        return not data.rstrip(b"\x00").endswith(b"\xff\xd9")
    if fmt == "GIF":
        return not data.rstrip(b"\x00").endswith(b";")
    return False


@dataclass(frozen=True, slots=True)
class _Decoded:
    image: Image.Image  # RGB, upright, at the target size
    upright_size: tuple[int, int]  # the header's size, turned upright
    conversions: tuple[str, ...]


def _decode(data: bytes, fmt: str, header_size: tuple[int, int], target: tuple[int, int],
            rules: ImageRules, name: str) -> _Decoded:
    """Decode the first frame, turn it upright, convert it to RGB and resize it to
    ``target`` (given in the stored orientation)."""
    with _decoding(data, fmt, name):
        source = _open_lazy(data, fmt)
        if source.size != header_size:
            raise SyntaxError(f"size {source.size} differs from the header's {header_size}")
        notes = _frames_note(source) + _draft_jpeg(source, target)
        _check_decode_cap(source.size[0] * source.size[1], rules, name)
        source.load()
        upright, orientation_note = _upright(source)
        rgb, mode_note = _to_rgb(upright, name)
        if upright.size != source.size:  # orientations 5-8 swap the axes
            header_size, target = header_size[::-1], target[::-1]
        if rgb.size != target:
            rgb = rgb.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
        if rgb is source:  # detach from the file object, so the bytes can be freed
            rgb = source.copy()
        notes += [note for note in (orientation_note, mode_note) if note]
        return _Decoded(image=rgb, upright_size=header_size, conversions=tuple(notes))


def _draft_jpeg(image: Image.Image, target: tuple[int, int]) -> list[str]:
    """Ask a JPEG decoder for the smallest scale that still covers ``target``."""
    if ALLOWED_FORMATS.get(image.format) != "JPEG" or target == image.size:
        return []
    before = image.size[0]
    image.draft(None, target)
    scale = round(before / image.size[0])
    return [f"jpeg_decoded_at_1/{scale}_scale"] if scale > 1 else []


def _upright(image: Image.Image) -> tuple[Image.Image, str | None]:
    """Apply EXIF orientation. Unreadable EXIF is noted rather than fatal: the pixels are fine."""
    try:
        orientation = image.getexif().get(_ORIENTATION_TAG)
        if not isinstance(orientation, int) or not 2 <= orientation <= 8:
            return image, None
        return ImageOps.exif_transpose(image), f"exif_transpose(orientation={orientation})"
    except Exception as exc:  # EXIF is untrusted metadata parsed in Python; any failure is its own
        return image, f"exif_unreadable({type(exc).__name__}, orientation ignored)"


def _to_rgb(image: Image.Image, name: str) -> tuple[Image.Image, str | None]:
    """Convert any Pillow mode to RGB; returns the image and a note naming the conversion.

    16-bit and 32-bit integer gray is scaled to 8 bits (not clipped); float gray is clipped
    to 0..255; anything with alpha or a transparent colour is composited onto white.
    """
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image, None
    try:
        return _converted(image)
    except ValueError as exc:  # Pillow has no path from this mode to RGB
        raise PreflightError("unsupported_mode", mode, "a mode convertible to RGB",
                             what="pixel mode", source=name) from exc


def _converted(image: Image.Image) -> tuple[Image.Image, str]:
    mode = image.mode
    if mode == "I":
        return _gray16_to_rgb(image), "I->RGB (32-bit clipped to 16-bit, scaled to 8-bit)"
    if mode in _INTEGER_GRAY_MODES:
        return _gray16_to_rgb(image), f"{mode}->RGB (16-bit scaled to 8-bit)"
    if mode == "F":
        return image.convert("L").convert("RGB"), "F->RGB (clipped to 0..255)"
    if mode in _ALPHA_MODES:
        return _on_white(image.convert("RGBA")), f"{mode}->RGB (alpha composited on white)"
    if "transparency" in image.info:
        return (_on_white(image.convert("RGBA")),
                f"{mode}+transparency->RGB (transparent pixels composited on white)")
    return image.convert("RGB"), f"{mode}->RGB"


def _gray16_to_rgb(image: Image.Image) -> Image.Image:
    values = np.asarray(image).astype(np.int64)
    if image.mode == "I":
        values = np.clip(values, 0, 65535)
    gray = ((values * 255 + 32767) // 65535).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")


def _on_white(rgba: Image.Image) -> Image.Image:
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _frames_note(image: Image.Image) -> list[str]:
    """Checked before ``load``: finding the second frame moves the reader, then rewinds."""
    try:
        animated = bool(getattr(image, "is_animated", False))
    except Exception:  # a damaged later frame; the first one still decodes or fails alone
        return ["first_frame (later frames unreadable)"]
    return ["first_frame (animated or multi-page)"] if animated else []


# ---------------------------------------------------------------- public entry points


def prepare_image(data: bytes, rules: ImageRules,
                  on_oversize: OnOversize | str = OnOversize.REJECT,
                  name: str = "image") -> PreparedImage:
    """Check and decode one image; raises ``PreflightError`` and nothing else for bad data."""
    on_oversize = OnOversize(on_oversize)
    data = bytes(data)
    _check_file_bytes(len(data), rules.max_file_bytes, name, exact=True)
    fmt = sniff_format(data, name)
    header_size = _header_size(data, fmt, name)
    _check_jpeg_data(data, fmt, header_size, rules, name)
    _check_decode_cap(pixels_to_decode(fmt, header_size), rules, name)
    _check_min_side(header_size, rules, name)
    target, fitted_to = _target_size(header_size, rules, on_oversize, name)
    decoded = _decode(data, fmt, header_size, target, rules, name)
    report = ImageReport(source=name, format=fmt, original_size=decoded.upright_size,
                         final_size=decoded.image.size,
                         action="downscaled" if fitted_to else "none",
                         conversions=decoded.conversions, fitted_to=fitted_to)
    return PreparedImage(image=decoded.image, report=report, sha256=content_hash(decoded.image))


def prepare_images(sources: Sequence[ImageSource], rules: ImageRules,
                   on_oversize: OnOversize | str = OnOversize.REJECT) -> list[PreparedImage]:
    """Check the image count first, then read and prepare each source in order."""
    if len(sources) > rules.max_images:
        override = (None if "max_images" in rules.model_limited
                    else f"--set images.max_images={len(sources)}")
        raise PreflightError("too_many_images", len(sources), rules.max_images, override,
                             what="images in the request (max_images)")
    prepared = []
    for index, source in enumerate(sources):
        unnamed = isinstance(source, (bytes, bytearray, memoryview))
        data, name = read_image_source(source, rules.max_file_bytes,
                                       name=f"image[{index}]" if unnamed else None)
        prepared.append(prepare_image(data, rules, on_oversize, name))
    return prepared


def check_text(text: str, what: str = "prompt") -> str:
    """``text`` if it can be sent to a tokenizer: valid Unicode that encodes as UTF-8. A lone
    surrogate (``"\\ud800"`` in JSON, or an undecodable byte of a command line) is an
    :class:`~edgeinfer.errors.InvalidParam` naming ``what`` and where, never the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        found = (f"the undecodable byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF
                 else f"U+{code:04X}, a lone surrogate (half of a UTF-16 pair)")
        raise InvalidParam(f"{what} is not valid UTF-8 text: character {exc.start} is {found}",
                           param=what) from None
    return text


def content_hash(image: Image.Image) -> str:
    """sha256 of the size and RGB pixels: equal pixels give equal keys, whatever the file."""
    width, height = image.size
    digest = hashlib.sha256(f"{width}x{height}:{image.mode}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- request cost

# Hidden-sized tensors alive at the peak of one vision-encoder layer: residual, normed
# input, q, k, v, attention output (6) and the MLP's 4x-wide intermediate with its
# activation (4 + 2). Fused attention is assumed; see ``eager_attention_heads``.
VISION_LIVE_TENSORS = 12


@dataclass(frozen=True, slots=True)
class CostEstimate:
    vision_tokens: int
    vision_activation_bytes: int
    kv_bytes: int
    total_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"vision_tokens": self.vision_tokens,
                "vision_activation_bytes": self.vision_activation_bytes,
                "kv_bytes": self.kv_bytes, "total_bytes": self.total_bytes}


def estimate_cost(vision_tokens: int, prompt_tokens: int, max_new_tokens: int, *,
                  vision_hidden: int, vision_layers_tokens_per_image: int,
                  kv_bytes_per_token: int, dtype_bytes: int,
                  eager_attention_heads: int = 0) -> CostEstimate:
    """Estimate a request's memory.

    - ``vision_tokens``: image tokens the decoder sees (after any patch merge), all images;
    - ``prompt_tokens``: text tokens of the prompt, without the image tokens;
    - ``vision_layers_tokens_per_image``: patches one encoder layer sees for the largest
      image (images are encoded one at a time, so the peak is one image's);
    - activations = patches x vision_hidden x dtype_bytes x VISION_LIVE_TENSORS,
      plus heads x patches^2 x dtype_bytes when attention is eager (scores materialised);
    - KV = (vision_tokens + prompt_tokens + max_new_tokens) x kv_bytes_per_token.
    """
    counts = {"vision_tokens": vision_tokens, "prompt_tokens": prompt_tokens,
              "max_new_tokens": max_new_tokens, "vision_hidden": vision_hidden,
              "vision_layers_tokens_per_image": vision_layers_tokens_per_image,
              "kv_bytes_per_token": kv_bytes_per_token, "dtype_bytes": dtype_bytes,
              "eager_attention_heads": eager_attention_heads}
    negative = {key: value for key, value in counts.items() if value < 0}
    if negative:
        raise ValueError(f"estimate_cost needs counts >= 0, got {negative}")
    patches = vision_layers_tokens_per_image
    activations = patches * dtype_bytes * (vision_hidden * VISION_LIVE_TENSORS
                                           + eager_attention_heads * patches)
    kv = (vision_tokens + prompt_tokens + max_new_tokens) * kv_bytes_per_token
    return CostEstimate(vision_tokens=vision_tokens, vision_activation_bytes=activations,
                        kv_bytes=kv, total_bytes=activations + kv)


def check_cost(estimate: CostEstimate, budget_bytes: int, available_floor_bytes: int) -> None:
    """Refuse a request over the profile's budget, or one that would push the memory
    available right now (psutil) under the profile's floor."""
    if estimate.total_bytes > budget_bytes:
        needed_mb = math.ceil(estimate.total_bytes / _MIB)
        raise PreflightError("memory", estimate.total_bytes, budget_bytes,
                             "fewer max_new_tokens, a smaller image (--on-oversize fit), or "
                             f"--set memory.kv_device_budget_mb={needed_mb}",
                             what="estimated request memory in bytes (profile budget)")
    left = psutil.virtual_memory().available - estimate.total_bytes
    if left < available_floor_bytes:
        floor_mb = max(0, left // _MIB)
        raise MemoryPressureError("memory", left, available_floor_bytes,
                                  "retry when memory is free, or "
                                  f"--set memory.available_floor_mb={floor_mb}",
                                  what="bytes available after this request (floor)")
