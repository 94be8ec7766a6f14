"""Image URLs of a request, turned into preflight-checked images.

A ``data:image/...;base64,`` URI is always accepted. ``http(s)://`` URLs are refused
unless the server was started with ``--allow-remote-images``, and then fetched with a
byte cap, a time limit and at most a few redirects. ``file://`` URLs are refused unless
``--allowed-local-dir`` is set, and then only for files that resolve inside it. Every
image then goes through :func:`edgeinfer.preflight.prepare_image`.

These functions block (decoding, downloading): the app calls them in a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from edgeinfer.errors import FileTooLargeError, PreflightError
from edgeinfer.preflight import ImageRules, OnOversize, PreparedImage, prepare_image, read_image_source
from edgeinfer.server.errors import InvalidParam

MAX_REDIRECTS = 3
_MIB = 2**20


@dataclass(frozen=True, slots=True)
class ImageSourcePolicy:
    """Where images may come from; ``allowed_local_dir`` is already resolved."""

    allow_remote: bool = False
    remote_timeout_s: float = 10.0
    allowed_local_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part of a request: its URL and where it sits (``messages[0].content[1]``)."""

    url: str
    where: str


def prepare_refs(refs: Sequence[ImageRef], rules: ImageRules, on_oversize: OnOversize | str,
                 policy: ImageSourcePolicy) -> list[PreparedImage]:
    """Check the count, then read and preflight each image in order."""
    if len(refs) > rules.max_images:
        override = None if "max_images" in rules.model_limited else f"--set images.max_images={len(refs)}"
        raise PreflightError("too_many_images", len(refs), rules.max_images, override,
                             what="images in the request (max_images)", source="messages")
    return [prepare_image(read_url(ref, rules.max_file_bytes, policy), rules, on_oversize, ref.where)
            for ref in refs]


def read_url(ref: ImageRef, max_bytes: int, policy: ImageSourcePolicy) -> bytes:
    url = ref.url.strip()
    if not url:
        raise InvalidParam(f"{ref.where}: image_url.url is empty; send a data:image/...;base64 URI",
                           f"{ref.where}.image_url.url")
    scheme = urlsplit(url).scheme.lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_uri(url, max_bytes, ref.where)
    if scheme in ("http", "https"):
        return fetch_remote(url, max_bytes, policy, ref.where)
    if scheme == "file":
        return read_local(url, max_bytes, policy, ref.where)
    raise InvalidParam(f"{ref.where}: unsupported image URL scheme {scheme or '(none)'!r}; use a "
                       f"data:image/...;base64 URI (or http(s):// / file:// where the server allows them)",
                       f"{ref.where}.image_url.url")


def decode_data_uri(url: str, max_bytes: int, where: str) -> bytes:
    """``data:[<media type>][;base64],<payload>``; only base64 payloads carry images."""
    param = f"{where}.image_url.url"
    header, comma, payload = url.partition(",")
    if not comma:
        raise InvalidParam(f"{where}: data URI has no ',' before its payload", param)
    if not header.lower().endswith(";base64"):
        raise InvalidParam(f"{where}: data URI is not base64 (expected data:image/png;base64,...)", param)
    # A base64 payload is 4/3 of the bytes it carries: refuse before decoding.
    estimated = len(payload) * 3 // 4
    if estimated > max_bytes + 2:
        raise FileTooLargeError("file_too_large", estimated, max_bytes,
                                f"--set images.max_file_mb={math.ceil(estimated / _MIB)}",
                                what="file size in bytes (decoded from base64)", source=where)
    compact = "".join(payload.split())  # some encoders wrap lines
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidParam(f"{where}: invalid base64 in data URI ({exc})", param) from None
    if not data:
        raise InvalidParam(f"{where}: data URI carries no bytes", param)
    return data


def read_local(url: str, max_bytes: int, policy: ImageSourcePolicy, where: str) -> bytes:
    param = f"{where}.image_url.url"
    root = policy.allowed_local_dir
    if root is None:
        raise InvalidParam(f"{where}: file:// image URLs are disabled; start the server with "
                           f"--allowed-local-dir DIR, or send a data URI", param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidParam(f"{where}: file:// URL names host {parts.netloc!r}; only local files are read", param)
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise InvalidParam(f"{where}: {path} is outside the allowed folder {root}", param)
    data, _ = read_image_source(path, max_bytes, name=where)
    return data


def fetch_remote(url: str, max_bytes: int, policy: ImageSourcePolicy, where: str) -> bytes:
    """GET ``url`` with the byte cap and one overall time limit; redirects only to http(s)."""
    param = f"{where}.image_url.url"
    if not policy.allow_remote:
        raise InvalidParam(f"{where}: remote image URLs are disabled; send a data:image/...;base64 URI, or "
                           f"start the server with --allow-remote-images", param)
    import httpx

    deadline = time.monotonic() + policy.remote_timeout_s
    try:
        with httpx.Client(timeout=policy.remote_timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        if urlsplit(url).scheme not in ("http", "https"):
                            raise InvalidParam(f"{where}: image URL redirects to a non-http(s) URL", param)
                        continue
                    if response.status_code != 200:
                        raise InvalidParam(f"{where}: fetching the image URL gave HTTP {response.status_code}",
                                           param)
                    return _read_capped(response, max_bytes, deadline, where, policy.remote_timeout_s)
    except httpx.TimeoutException:
        raise InvalidParam(f"{where}: fetching the image URL took over {policy.remote_timeout_s:g} s "
                           f"(override: --remote-image-timeout)", param) from None
    except httpx.HTTPError as exc:
        raise InvalidParam(f"{where}: fetching the image URL failed ({type(exc).__name__}: {exc})", param) from None
    raise InvalidParam(f"{where}: image URL redirects more than {MAX_REDIRECTS} times", param)


def _read_capped(response, max_bytes: int, deadline: float, where: str, timeout_s: float) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        _too_large(int(declared), max_bytes, where)
    chunks, total = [], 0
    for chunk in response.iter_bytes(64 * 1024):
        total += len(chunk)
        if total > max_bytes:
            _too_large(total, max_bytes, where)
        if time.monotonic() > deadline:
            raise InvalidParam(f"{where}: fetching the image URL took over {timeout_s:g} s "
                               f"(override: --remote-image-timeout)", f"{where}.image_url.url")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int, where: str) -> None:
    raise FileTooLargeError("file_too_large", size, max_bytes, f"--set images.max_file_mb={math.ceil(size / _MIB)}",
                            what="file size in bytes", source=where)
