"""Image URLs of a request, read into bytes that preflight then checks.

A ``data:image/...;base64,`` URI is always accepted. ``http(s)://`` URLs are refused
unless the server was started with ``--allow-remote-images``, and then fetched with a
byte cap, at most a few redirects, and one deadline over the whole fetch (redirects,
headers and a slow body together). ``file://`` URLs are refused unless
``--allowed-local-dir`` is set, and then only for files that resolve inside it. The bytes
then go through the decode stage (:mod:`edgeinfer.server.decoding`).

:func:`read_ref` is a coroutine; the blocking parts (base64, the file system) run on a
worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from edgeinfer.errors import FileTooLargeError
from edgeinfer.preflight import read_image_source
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


async def read_ref(ref: ImageRef, max_bytes: int, policy: ImageSourcePolicy) -> bytes:
    url = ref.url.strip()
    if not url:
        raise InvalidParam(f"{ref.where}: image_url.url is empty; send a data:image/...;base64 URI",
                           f"{ref.where}.image_url.url")
    scheme = urlsplit(url).scheme.lower() if ":" in url else ""
    if scheme == "data":
        return await asyncio.to_thread(decode_data_uri, url, max_bytes, ref.where)
    if scheme in ("http", "https"):
        return await fetch_remote(url, max_bytes, policy, ref.where)
    if scheme == "file":
        return await asyncio.to_thread(read_local, url, max_bytes, policy, ref.where)
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


async def fetch_remote(url: str, max_bytes: int, policy: ImageSourcePolicy, where: str) -> bytes:
    """GET ``url`` with the byte cap; redirects only to http(s); ``remote_timeout_s`` is one
    deadline for the whole fetch, however the time is spent (hops, trickled headers or body)."""
    param = f"{where}.image_url.url"
    if not policy.allow_remote:
        raise InvalidParam(f"{where}: remote image URLs are disabled; send a data:image/...;base64 URI, or "
                           f"start the server with --allow-remote-images", param)
    import httpx

    try:
        async with asyncio.timeout(policy.remote_timeout_s):
            return await _fetch(url, max_bytes, policy.remote_timeout_s, where)
    except (TimeoutError, httpx.TimeoutException):
        raise InvalidParam(f"{where}: fetching the image URL took over {policy.remote_timeout_s:g} s in all "
                           f"(override: --remote-image-timeout)", param) from None
    except httpx.HTTPError as exc:
        raise InvalidParam(f"{where}: fetching the image URL failed ({type(exc).__name__}: {exc})", param) from None


async def _fetch(url: str, max_bytes: int, timeout_s: float, where: str) -> bytes:
    import httpx

    param = f"{where}.image_url.url"
    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    if urlsplit(url).scheme not in ("http", "https"):
                        raise InvalidParam(f"{where}: image URL redirects to a non-http(s) URL", param)
                    continue
                if response.status_code != 200:
                    raise InvalidParam(f"{where}: fetching the image URL gave HTTP {response.status_code}", param)
                return await _read_capped(response, max_bytes, where)
    raise InvalidParam(f"{where}: image URL redirects more than {MAX_REDIRECTS} times", param)


async def _read_capped(response, max_bytes: int, where: str) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        _too_large(int(declared), max_bytes, where)
    chunks, total = [], 0
    async for chunk in response.aiter_bytes(64 * 1024):
        total += len(chunk)
        if total > max_bytes:
            _too_large(total, max_bytes, where)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int, where: str) -> None:
    raise FileTooLargeError("file_too_large", size, max_bytes, f"--set images.max_file_mb={math.ceil(size / _MIB)}",
                            what="file size in bytes", source=where)
