#!/usr/bin/env python3
"""A bounded loopback load test of ``edgeinfer serve``.

    python scripts/load_test.py                       # the demo model (or a tiny random one)
    python scripts/load_test.py --model DIR --requests 200 --concurrency 16 --malformed 0.2

It starts the daemon as a child process on 127.0.0.1 (a free port), answers a few
questions with the engine in this process to know the right answers, warms the server
up, then sends ``--requests`` requests at ``--concurrency``, a share of them malformed
(bad base64, an oversized image, invalid JSON, wrong types, a missing image), through
/v1/chat/completions (plain and streaming) and /v1/vqa. It checks that:

- every valid request is answered with the engine's own answer, or refused with 503 and
  Retry-After (retried at most ``--retries`` times, after the advertised delay);
- every malformed one gets a 4xx whose message names the problem; nothing gets another 5xx;
- the server is healthy afterwards, its RSS grew less than 10% after warm-up, and
  /metrics shows every KV block free (no sequence holds one; blocks idle in the prefix
  cache count as free, as the pool counts them);
- SIGTERM stops it with exit status 0.

With ``--hostile`` it then runs two more phases of the same valid traffic
(``--hostile-requests`` requests): one alone (the quiet baseline) and one while
``--hostile-concurrency`` clients keep sending a hostile mix (a 5 MB prompt, a batch of
8,000 image items, a PNG that decodes to nearly 24 MP with ``fit``, lone surrogates in
plain, streaming and batch requests, a wrong API key with a broken body, ``max_tokens``
past the context, a client that trickles its body, a client that stops reading its
stream). It reports the valid requests' p50/p95/p99 latency in each phase and their
ratio, the server's peak RSS in each phase (sampled every 0.1 s), and the status codes of
both kinds of traffic; it checks that no response is a 5xx other than 503 (overload), that
each hostile request got one of the statuses its kind allows, and that the valid p99 under
the hostile mix is within ``--p99-ratio-limit`` of the quiet one.

Traffic goes to 127.0.0.1 only; the run stops after ``--time-limit`` seconds whatever
happens. The figures are printed (and written as JSON with ``--json``); the exit status
is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeinfer.demo import DEMO_MODEL_DIR  # noqa: E402

HOST = "127.0.0.1"
MALFORMED_KINDS = ("bad_base64", "oversized_image", "invalid_json", "wrong_types", "missing_image")
# What each malformed kind must get: a status and a word the error message must contain.
EXPECTED_ERRORS = {
    "bad_base64": (400, "base64"),
    "oversized_image": (422, "max_side"),
    "invalid_json": (400, "JSON"),
    "wrong_types": (422, "max_tokens"),
    "missing_image": (422, "image"),
}
RSS_GROWTH_LIMIT = 0.10
# The hostile mix: each kind, and the statuses it may get (503: overload, try later).
HOSTILE_KINDS = {
    "big_prompt": {413, 422},  # 5 MB of text: refused by its length, never tokenized
    "big_batch": {400, 413, 422},  # 8,000 image items: counted before any item is validated
    "huge_decode": {200, 503},  # nearly 24 MP to decode (fit): through the decode budget
    "surrogate_plain": {422},
    "surrogate_stream": {422},
    "surrogate_batch": {422},
    "bad_auth": {401},  # a wrong key and a broken body: 401 before the body is parsed
    "over_context": {422},  # max_tokens past the context, however busy the server is
    "slow_body": {0, 400, 408, 413},  # trickles its body, then leaves (0: no answer waited for)
    "slow_reader": {0, 200, 503},  # reads one event of its stream, stalls, then leaves
}
SLOW_CLIENT_S = 3.0
HOSTILE_HEAD_START_S = 5.0
TINY_PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")


@dataclass(frozen=True, slots=True)
class Question:
    png: bytes
    text: str
    expected: str  # the engine's own answer
    truth: str | None  # the synthetic picture's answer, when the demo model is served


@dataclass(slots=True)
class Outcome:
    kind: str  # "chat", "stream", "vqa" or a malformed kind
    status: int
    ok: bool
    seconds: float
    detail: str = ""
    retries: int = 0
    correct_truth: bool | None = None


@dataclass(slots=True)
class Figures:
    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start_server(model: Path, profile: str, overrides: list[str], api_key: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "edgeinfer.cli.main", "serve", "--model", str(model), "--profile", profile,
               "--host", HOST, "--port", str(port), "--log-level", "warning", "--backend", "torch"]
    for item in overrides:
        command += ["--set", item]
    log = tempfile.NamedTemporaryFile(prefix="edgeinfer-load-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "EDGEINFER_API_KEY": api_key})
    print(f"server: pid {process.pid}, http://{HOST}:{port}, log {log.name}")
    return process, f"http://{HOST}:{port}"


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} while loading")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready after {timeout_s} s")


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def scrape(url: str, headers: dict) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def device_blocks(metrics: dict[str, float]) -> dict[str, float]:
    """Device KV blocks by state: free and used, or (with the KV manager) running, idle, ..."""
    found = {}
    for key, value in metrics.items():
        match = re.match(r'^edgeinfer_kv_blocks\{state="(\w+)",tier="device"\}$', key)
        if match:
            found[match.group(1)] = value
    return found


def held_blocks(blocks: dict[str, float]) -> float:
    """Blocks a sequence owns or a transfer holds; idle prefix-cache blocks are free to take."""
    return sum(v for state, v in blocks.items() if state not in ("free", "idle")) if blocks else -1.0


# --------------------------------------------------------------------------- requests


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_body(question: Question, max_tokens: int, stream: bool) -> dict:
    content = [{"type": "image_url", "image_url": {"url": data_uri(question.png)}},
               {"type": "text", "text": question.text}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def questions_for(model: Path, is_demo: bool, n: int, max_tokens: int, seed: int) -> list[Question]:
    """Pictures and questions, with the answers the engine gives directly (greedy)."""
    from edgeinfer.engine import Engine, SamplingParams

    engine = Engine.load(model, profile="cpu", backend="torch",
                         overrides=["kv.device_blocks=512", "memory.disk_tier_mb=0"])
    sampling = SamplingParams(max_new_tokens=max_tokens)
    if is_demo:
        from edgeinfer.demo import synthetic

        samples = [(s.image, s.question, s.answer) for s in synthetic.held_out(seed, n)]
    else:
        import numpy as np

        rng = np.random.RandomState(seed)
        words = ("what is in the image ?", "describe this picture", "what color", "how many")
        samples = [(Image.fromarray(rng.randint(0, 256, (64 + 16 * i, 96, 3), dtype=np.uint8)),
                    words[i % len(words)], None) for i in range(n)]
    out = []
    for image, text, truth in samples:
        data = png(image.convert("RGB"))
        expected = engine.generate(text, [Image.open(io.BytesIO(data))], sampling).text
        out.append(Question(data, text, expected, truth))
    return out


def malformed_request(kind: str, question: Question, oversized_png: bytes) -> tuple[str, dict]:
    """(path, httpx request arguments) for one malformed request."""
    if kind == "bad_base64":
        body = chat_body(question, 4, False)
        body["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,iVBOR!!not-base64!!"
        return "/v1/chat/completions", {"json": body}
    if kind == "oversized_image":
        body = chat_body(question, 4, False)
        body["messages"][0]["content"][0]["image_url"]["url"] = data_uri(oversized_png)
        return "/v1/chat/completions", {"json": body}
    if kind == "invalid_json":
        return "/v1/chat/completions", {"content": b'{"messages": [{"role": "user", "content": "hi"}',
                                        "headers": {"content-type": "application/json"}}
    if kind == "wrong_types":
        body = chat_body(question, 4, False)
        body["max_tokens"] = "plenty"
        return "/v1/chat/completions", {"json": body}
    if kind == "missing_image":
        return "/v1/vqa", {"data": {"question": question.text, "max_tokens": "4"}}
    raise ValueError(kind)


async def send_valid(client: httpx.AsyncClient, kind: str, question: Question, max_tokens: int,
                     retries: int) -> Outcome:
    started = time.perf_counter()
    for attempt in range(retries + 1):
        status, answer, detail, retry_after = await _valid_once(client, kind, question, max_tokens)
        if status != 503 or attempt == retries:
            break
        await asyncio.sleep(min(float(retry_after or 1), 5.0))
    seconds = time.perf_counter() - started
    if status == 200:
        truth = None if question.truth is None else answer.strip().lower() == question.truth
        ok = answer == question.expected
        return Outcome(kind, status, ok, seconds, "" if ok else f"answer {answer!r} != {question.expected!r}",
                       attempt, truth)
    ok = status == 503 and retry_after is not None and retry_after.isdigit()
    return Outcome(kind, status, ok, seconds, detail if not ok else "refused with Retry-After", attempt)


async def _valid_once(client, kind, question, max_tokens) -> tuple[int, str, str, str | None]:
    if kind == "vqa":
        response = await client.post("/v1/vqa", files={"image": ("frame.png", question.png, "image/png")},
                                     data={"question": question.text, "max_tokens": str(max_tokens)})
        return response.status_code, _field(response, "answer"), response.text[:200], \
            response.headers.get("retry-after")
    if kind == "chat":
        response = await client.post("/v1/chat/completions", json=chat_body(question, max_tokens, False))
        answer = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else ""
        return response.status_code, answer, response.text[:200], response.headers.get("retry-after")
    async with client.stream("POST", "/v1/chat/completions", json=chat_body(question, max_tokens, True)) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, "", response.text[:200], response.headers.get("retry-after")
        pieces, done = [], False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return 500, "", f"error event: {event['error']}", None
                pieces += [c["delta"].get("content") or "" for c in event["choices"]]
        return (200 if done else 599), "".join(pieces), "" if done else "stream ended without [DONE]", None


def _field(response: httpx.Response, name: str) -> str:
    return response.json().get(name, "") if response.status_code == 200 else ""


async def send_malformed(client: httpx.AsyncClient, kind: str, question: Question, oversized: bytes) -> Outcome:
    path, arguments = malformed_request(kind, question, oversized)
    started = time.perf_counter()
    response = await client.post(path, **arguments)
    seconds = time.perf_counter() - started
    status, word = EXPECTED_ERRORS[kind]
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    ok = response.status_code == status and word.lower() in message.lower()
    return Outcome(kind, response.status_code, ok, seconds, message[:160])


def plan(n: int, malformed_share: float, seed: int) -> list[str]:
    """The kinds of ``n`` requests in a shuffled order: malformed kinds in turn, valid ones
    split 60/25/15 over plain chat, streaming chat and /v1/vqa."""
    rng = random.Random(seed)
    bad = round(n * malformed_share)
    kinds = [MALFORMED_KINDS[i % len(MALFORMED_KINDS)] for i in range(bad)]
    kinds += rng.choices(("chat", "stream", "vqa"), weights=(60, 25, 15), k=n - bad)
    rng.shuffle(kinds)
    return kinds


async def run_load(url: str, api_key: str, kinds: list[str], questions: list[Question], concurrency: int,
                   max_tokens: int, retries: int, oversized: bytes, time_limit_s: float) -> list[Outcome]:
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, limits=limits,
                                 timeout=httpx.Timeout(120.0)) as client:

        async def one(i: int, kind: str) -> Outcome:
            async with semaphore:
                question = questions[i % len(questions)]
                try:
                    if kind in MALFORMED_KINDS:
                        return await send_malformed(client, kind, question, oversized)
                    return await send_valid(client, kind, question, max_tokens, retries)
                except httpx.HTTPError as exc:
                    return Outcome(kind, 0, False, 0.0, f"{type(exc).__name__}: {exc}")

        return await asyncio.wait_for(asyncio.gather(*(one(i, k) for i, k in enumerate(kinds))), time_limit_s)


# --------------------------------------------------------------------------- the hostile mix


def hostile_arguments(kind: str, question: Question, huge_png: bytes) -> tuple[str, dict]:
    """(path, httpx request arguments) for one hostile request of ``kind`` (the two slow kinds aside);
    bodies are encoded here, once, so the attackers spend their time sending, not encoding."""
    path, arguments = _hostile_request(kind, question, huge_png)
    if "json" in arguments:
        headers = {**arguments.get("headers", {}), "content-type": "application/json"}
        arguments = {"content": json.dumps(arguments["json"]).encode(), "headers": headers}
    return path, arguments


def _hostile_request(kind: str, question: Question, huge_png: bytes) -> tuple[str, dict]:
    surrogate_text = '{"role": "user", "content": "\\ud800 what is this?"}'
    raw = {"headers": {"content-type": "application/json"}}
    if kind == "big_prompt":
        return "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "lorem ipsum " * 440_000}],
                                                 "max_tokens": 4}}
    if kind == "big_batch":
        item = chat_body(Question(TINY_PNG, question.text, "", None), 1, False)
        return "/v1/chat/completions/batch", {"json": {"requests": [item] * 8000}}
    if kind == "huge_decode":
        body = chat_body(question, 1, False)
        body["messages"][0]["content"][0]["image_url"]["url"] = data_uri(huge_png)
        return "/v1/chat/completions", {"json": {**body, "on_oversize": "fit"}}
    if kind == "surrogate_plain":
        return "/v1/chat/completions", {"content": f'{{"messages": [{surrogate_text}], "max_tokens": 4}}'.encode(),
                                        **raw}
    if kind == "surrogate_stream":
        return "/v1/chat/completions", {"content": f'{{"messages": [{surrogate_text}], "stream": true}}'.encode(),
                                        **raw}
    if kind == "surrogate_batch":
        body = f'{{"requests": [{{"messages": [{surrogate_text}], "max_tokens": 4}}]}}'
        return "/v1/chat/completions/batch", {"content": body.encode(), **raw}
    if kind == "bad_auth":
        return "/v1/chat/completions", {"content": b'{"messages": [', "headers": {
            "content-type": "application/json", "authorization": "Bearer not-the-key"}}
    if kind == "over_context":
        return "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1_000_000}}
    raise ValueError(kind)


async def slow_body(url: str, api_key: str) -> int:
    """Declare a 1 MB body, send a byte every 0.5 s for SLOW_CLIENT_S, then leave."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{{".encode())
        await writer.drain()
        deadline = time.monotonic() + SLOW_CLIENT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            writer.write(b" ")
            await writer.drain()
        return 0
    finally:
        writer.close()


async def slow_reader(client: httpx.AsyncClient, question: Question) -> int:
    body = {**chat_body(question, 256, True), "ignore_eos": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        lines = response.aiter_lines()
        await anext(lines)
        await asyncio.sleep(SLOW_CLIENT_S)
        return 0  # leaving mid-stream: the server cancels the generation


async def send_hostile(client: httpx.AsyncClient, url: str, api_key: str, kind: str, question: Question,
                       requests: dict[str, tuple[str, dict]]) -> Outcome:
    started = time.perf_counter()
    try:
        if kind == "slow_body":
            status, detail = await slow_body(url, api_key), ""
        elif kind == "slow_reader":
            status, detail = await slow_reader(client, question), ""
        else:
            path, arguments = requests[kind]
            response = await client.post(path, **arguments)
            status, detail = response.status_code, response.text[:160]
    except (httpx.HTTPError, OSError) as exc:
        status, detail = -1, f"{type(exc).__name__}: {exc}"
    ok = status in HOSTILE_KINDS[kind]
    return Outcome(kind, status, ok, time.perf_counter() - started, "" if ok else detail)


def hostile_process(url: str, api_key: str, question: Question, concurrency: int, kinds: list[str],
                    interval_s: float, stop, results) -> None:
    """The hostile mix in a process of its own, so that building and sending it takes no time from
    the valid clients being measured: ``concurrency`` clients cycle through the kinds until
    ``stop`` (a multiprocessing Event) is set; the outcomes go to ``results`` (a Queue)."""
    # Solid colour: a few KB on the wire, just under the 24 MP decode cap once decoded.
    huge_png = png(Image.new("RGB", (5999, 3999), (40, 160, 40)))
    requests = {kind: hostile_arguments(kind, question, huge_png) for kind in kinds
                if kind not in ("slow_body", "slow_reader")}
    results.put(asyncio.run(_attack(url, api_key, question, concurrency, kinds, interval_s, requests, stop)))


async def _attack(url: str, api_key: str, question: Question, concurrency: int, kinds: list[str],
                  interval_s: float, requests: dict[str, tuple[str, dict]], stop) -> list[Outcome]:
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"},
                                 timeout=httpx.Timeout(120.0)) as client:

        async def attacker(offset: int) -> None:
            i = offset
            while not stop.is_set():
                kind = kinds[i % len(kinds)]
                started = time.monotonic()
                outcomes.append(await send_hostile(client, url, api_key, kind, question, requests))
                i += 1
                await asyncio.sleep(max(0.0, started + interval_s - time.monotonic()))

        await asyncio.gather(*(attacker(k) for k in range(concurrency)))
    return outcomes


async def sample_rss(pid: int, stop: asyncio.Event, every_s: float = 0.1) -> float:
    """The peak RSS of ``pid`` in MiB until ``stop`` is set."""
    peak = rss_mb(pid)
    while not stop.is_set():
        peak = max(peak, rss_mb(pid))
        await asyncio.sleep(every_s)
    return peak


async def valid_phase(url: str, api_key: str, pid: int, questions: list[Question],
                      args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """The valid traffic of one phase: (its outcomes, the server's peak RSS in MiB meanwhile)."""
    kinds = plan(args.hostile_requests, 0.0, args.seed + 1)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, stop))
    try:
        valid = await run_load(url, api_key, kinds, questions, args.concurrency, args.max_tokens, args.retries,
                               b"", args.time_limit)
    finally:
        stop.set()
    return valid, await sampler


def hostile_report(quiet: list[Outcome], loud: list[Outcome], hostile: list[Outcome],
                   rss_peak: dict[str, float], ratio_limit: float) -> tuple[dict, list[str]]:
    def latency(outcomes: list[Outcome]) -> dict[str, float]:
        seconds = [o.seconds for o in outcomes if o.status == 200]
        return {f"p{round(q * 100)}": round(percentile(seconds, q), 3) for q in (0.5, 0.95, 0.99)}

    quiet_lat, loud_lat = latency(quiet), latency(loud)
    ratio = loud_lat["p99"] / quiet_lat["p99"] if quiet_lat["p99"] > 0 else float("nan")
    everything = [*quiet, *loud, *hostile]
    figures = {
        "valid_requests_per_phase": len(quiet),
        "valid_latency_quiet_s": quiet_lat, "valid_latency_hostile_s": loud_lat,
        "valid_p99_ratio": round(ratio, 2),
        "valid_status_quiet": dict(sorted(Counter(o.status for o in quiet).items())),
        "valid_status_hostile": dict(sorted(Counter(o.status for o in loud).items())),
        "hostile_requests": len(hostile),
        "hostile_status": {kind: dict(sorted(Counter(o.status for o in hostile if o.kind == kind).items()))
                           for kind in HOSTILE_KINDS},
        "rss_peak_mb": {k: round(v, 1) for k, v in rss_peak.items()},
        "server_5xx_other_than_503": sum(500 <= o.status < 600 and o.status != 503 for o in everything),
    }
    failures = [f"valid under the hostile mix: {o.kind}: status {o.status}: {o.detail}" for o in loud if not o.ok]
    failures += [f"hostile {o.kind}: status {o.status} not in {sorted(HOSTILE_KINDS[o.kind])}: {o.detail}"
                 for o in hostile if not o.ok]
    if figures["server_5xx_other_than_503"]:
        failures.append(f"{figures['server_5xx_other_than_503']} responses were 5xx other than 503")
    if not ratio <= ratio_limit:
        failures.append(f"valid p99 under the hostile mix is {ratio:.2f}x the quiet one (limit {ratio_limit}x)")
    return figures, failures


# --------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(outcomes: list[Outcome], wall_s: float, rss: dict[str, float], metrics: dict[str, float],
           healthy: bool, exit_status: int | None, concurrency: int) -> tuple[dict, list[str]]:
    valid = [o for o in outcomes if o.kind not in MALFORMED_KINDS]
    malformed = [o for o in outcomes if o.kind in MALFORMED_KINDS]
    answered = [o for o in valid if o.status == 200]
    truths = [o.correct_truth for o in answered if o.correct_truth is not None]
    growth = (rss["after"] - rss["warm"]) / rss["warm"]
    blocks = device_blocks(metrics)
    held = held_blocks(blocks)
    figures = {
        "requests": len(outcomes), "concurrency": concurrency, "wall_s": round(wall_s, 2),
        "throughput_rps": round(len(outcomes) / wall_s, 2),
        "valid": len(valid), "answered": len(answered), "answered_right": sum(o.ok for o in answered),
        "refused_503_final": sum(o.status == 503 for o in valid),
        "retries_after_503": sum(o.retries for o in valid),
        "malformed": len(malformed), "malformed_4xx_named": sum(o.ok for o in malformed),
        "status_counts": dict(sorted(Counter(o.status for o in outcomes).items())),
        "malformed_status": {k: dict(Counter(o.status for o in malformed if o.kind == k)) for k in MALFORMED_KINDS},
        # 503 + Retry-After is the allowed refusal; any other 5xx is a server error.
        "server_5xx_other_than_503": sum(500 <= o.status < 600 and o.status != 503 for o in outcomes),
        "latency_s": {"p50": round(percentile([o.seconds for o in answered], 0.5), 3),
                      "p95": round(percentile([o.seconds for o in answered], 0.95), 3),
                      "max": round(max((o.seconds for o in answered), default=float("nan")), 3)},
        "ground_truth_accuracy": round(statistics.mean(truths), 3) if truths else None,
        "rss_mb": {k: round(v, 1) for k, v in rss.items()}, "rss_growth_after_warmup": round(growth, 4),
        "kv_device_blocks": blocks, "kv_blocks_held": held, "healthy_after": healthy,
        "sigterm_exit_status": exit_status,
        "ttft_mean_s": _mean(metrics, "edgeinfer_time_to_first_token_seconds"),
        "tpot_mean_s": _mean(metrics, "edgeinfer_time_per_output_token_seconds"),
    }
    failures = [f"{o.kind}: status {o.status}: {o.detail}" for o in outcomes if not o.ok]
    if figures["server_5xx_other_than_503"]:
        failures.append(f"{figures['server_5xx_other_than_503']} responses were 5xx other than 503")
    if growth >= RSS_GROWTH_LIMIT:
        failures.append(f"RSS grew {growth:.1%} after warm-up (limit {RSS_GROWTH_LIMIT:.0%})")
    if held != 0 or not blocks:
        failures.append(f"KV blocks not all free at the end: {blocks}")
    if not healthy:
        failures.append("the server was not healthy after the run")
    if exit_status != 0:
        failures.append(f"SIGTERM exit status {exit_status}, expected 0")
    return figures, failures


def _mean(metrics: dict[str, float], name: str) -> float | None:
    count = metrics.get(f"{name}_count", 0)
    return round(metrics[f"{name}_sum"] / count, 4) if count else None


def stop(process: subprocess.Popen, grace_s: float = 30) -> int | None:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint folder (default: the demo model, else a tiny random checkpoint)")
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=None,
                        help="profile override for the server (repeatable; default: kv.device_blocks=2048, "
                             "a pool small enough that RSS growth is not hidden under it, and kv.disk_dir in a "
                             "temporary folder)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--malformed", type=float, default=0.2, help="share of malformed requests")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--retries", type=int, default=2, help="retries of a 503, after its Retry-After")
    parser.add_argument("--questions", type=int, default=8, help="distinct pictures and questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole load phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--hostile", action="store_true",
                        help="also measure valid traffic alone and beside the hostile mix (see above)")
    parser.add_argument("--hostile-requests", type=int, default=100, help="valid requests in each hostile phase")
    parser.add_argument("--hostile-concurrency", type=int, default=4, help="clients sending the hostile mix")
    parser.add_argument("--hostile-interval", type=float, default=0.25,
                        help="seconds from the start of one hostile request of a client to its next (0: back to "
                             "back, a flood)")
    parser.add_argument("--hostile-kinds", default=",".join(HOSTILE_KINDS),
                        help=f"comma-separated kinds of the hostile mix (default: all of {', '.join(HOSTILE_KINDS)})")
    parser.add_argument("--p99-ratio-limit", type=float, default=2.0,
                        help="valid p99 under the hostile mix over the quiet p99 that still passes")
    args = parser.parse_args()
    if args.requests < 1 or args.requests > 10_000 or not 1 <= args.concurrency <= 64:
        parser.error("--requests must be in 1..10000 and --concurrency in 1..64 (a bounded test)")
    args.hostile_kinds = [kind.strip() for kind in args.hostile_kinds.split(",") if kind.strip()]
    unknown = sorted(set(args.hostile_kinds) - set(HOSTILE_KINDS))
    if unknown or not args.hostile_kinds:
        parser.error(f"--hostile-kinds: unknown {unknown or 'none given'}; choose from {', '.join(HOSTILE_KINDS)}")
    if not 1 <= args.hostile_requests <= 10_000 or not 1 <= args.hostile_concurrency <= 16:
        parser.error("--hostile-requests must be in 1..10000 and --hostile-concurrency in 1..16 (a bounded test)")
    return args


LOAD_AT_START = [round(x, 2) for x in os.getloadavg()]


def main() -> int:
    args = parse_args()
    is_demo = args.model is None and (DEMO_MODEL_DIR / "model.safetensors").is_file()
    model = args.model or (DEMO_MODEL_DIR if is_demo else None)
    if model is None:
        from edgeinfer.testing.checkpoints import make_checkpoint

        model = Path(make_checkpoint("smolvlm", Path(tempfile.mkdtemp(prefix="edgeinfer-tiny-"))))
        print(f"the demo model is absent: serving a tiny random checkpoint ({model})")
    scratch = Path(tempfile.mkdtemp(prefix="edgeinfer-load-kv-"))  # the disk tier, never the user's cache
    overrides = args.overrides if args.overrides is not None else ["kv.device_blocks=2048",
                                                                   f"kv.disk_dir={scratch}"]
    print(f"reference answers from the engine in this process ({args.questions} questions)")
    questions = questions_for(model, is_demo, args.questions, args.max_tokens, args.seed)
    oversized = png(Image.new("RGB", (1600, 40), (90, 90, 90)))  # over max_side on every shipped profile
    api_key = secrets.token_urlsafe(24)
    process, url = start_server(model, args.profile, overrides, api_key)
    exit_status = None
    try:
        print(f"ready in {wait_ready(url, process, 300):.1f} s")
        headers = {"Authorization": f"Bearer {api_key}"}
        warm = asyncio.run(run_load(url, api_key, ["chat", "stream", "vqa"] * (args.warmup // 3 + 1), questions,
                                    args.concurrency, args.max_tokens, args.retries, oversized, args.time_limit))
        rss = {"warm": rss_mb(process.pid)}
        print(f"warm-up: {len(warm)} requests, statuses {dict(Counter(o.status for o in warm))}, "
              f"RSS {rss['warm']:.0f} MiB")
        kinds = plan(args.requests, args.malformed, args.seed)
        started = time.perf_counter()
        outcomes = asyncio.run(run_load(url, api_key, kinds, questions, args.concurrency, args.max_tokens,
                                        args.retries, oversized, args.time_limit))
        wall_s = time.perf_counter() - started
        rss["after"] = rss_mb(process.pid)
        hostile_figures, hostile_failures = (run_hostile_phases(url, api_key, process.pid, questions, args)
                                             if args.hostile else ({}, []))
        metrics = _settled_metrics(url, headers)
        healthy = (httpx.get(f"{url}/health", timeout=5).status_code == 200
                   and httpx.get(f"{url}/ready", timeout=5).status_code == 200)
    finally:
        exit_status = stop(process)
    figures, failures = report(outcomes, wall_s, rss, metrics, healthy, exit_status, args.concurrency)
    if args.hostile:
        figures["hostile"] = hostile_figures
        failures += hostile_failures
    print(json.dumps(figures, indent=2))
    if args.json:
        settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                    if key != "json"}
        machine = {"cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                   "load_average_at_start": LOAD_AT_START}
        args.json.write_text(json.dumps({"command": "python scripts/load_test.py " + " ".join(
                                             arg if arg != str(args.json) else args.json.name for arg in sys.argv[1:]),
                                         "settings": settings, "machine": machine, "figures": figures,
                                         "failures": failures}, indent=2))
    for failure in failures[:30]:
        print(f"FAIL {failure}")
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


def run_hostile_phases(url: str, api_key: str, pid: int, questions: list[Question],
                       args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The quiet baseline, then the same valid traffic beside the hostile mix (from a child process)."""
    print(f"hostile phases: {args.hostile_requests} valid requests alone, then beside "
          f"{args.hostile_concurrency} hostile clients")
    quiet, quiet_rss = asyncio.run(valid_phase(url, api_key, pid, questions, args))
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    attacker = context.Process(target=hostile_process, daemon=True,
                               args=(url, api_key, questions[0], args.hostile_concurrency, args.hostile_kinds,
                                     args.hostile_interval, stop, results))
    attacker.start()
    time.sleep(HOSTILE_HEAD_START_S)  # the mix is under way before the measured traffic starts
    try:
        loud, loud_rss = asyncio.run(valid_phase(url, api_key, pid, questions, args))
    finally:
        stop.set()
    hostile = results.get(timeout=SLOW_CLIENT_S + 180)
    attacker.join(30)
    return hostile_report(quiet, loud, hostile, {"quiet": quiet_rss, "hostile": loud_rss}, args.p99_ratio_limit)


def _settled_metrics(url: str, headers: dict, timeout_s: float = 10.0) -> dict[str, float]:
    """/metrics once the engine thread has published its idle state (it does within 0.2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url, headers)
        settled = metrics.get("edgeinfer_requests_running") == 0 and held_blocks(device_blocks(metrics)) == 0
        if settled or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
