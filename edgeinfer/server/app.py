"""The HTTP daemon: ``create_app(settings)`` builds the FastAPI app.

Nothing is loaded at import or in ``create_app``: the app's lifespan starts loading the
model in a worker thread, so ``/health`` answers at once and ``/ready`` turns 200 when
the model is in. The engine then runs on its own thread (``AsyncEngine``); handlers
only submit requests to it and await their tokens.

Every check comes before admission, and none on the engine thread, in order of cost: the
API key before the body is read; the body's size; its schema (strict types, valid
Unicode); the batch's item count; the prompt's characters against the context (before
tokenizing); the image count (before decoding); each image through the bounded decode
stage (:mod:`edgeinfer.server.decoding`); then rendering, tokenizing and the context and
memory checks on the engine's prepare thread. Only then is the request submitted, and
only there is "busy" (503 + Retry-After) an answer: a request that can never fit gets its
4xx however busy the server is.

On shutdown (:func:`edgeinfer.server.daemon.serve`) the requests in flight get the
profile's ``shutdown_grace_s`` to finish; then queued ones are answered 503 + Retry-After
(``shutting_down``) and running streams end with an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import edgeinfer
from edgeinfer.engine.async_engine import (AsyncEngine, Completion, GenerationRequest, RequestHandle,
                                           freeze_start_up_objects)
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import (
    EdgeInferError, PreflightError, RequestCancelled, RequestError, http_status_for, mapping_for,
)
from edgeinfer.preflight import ImageRules, read_image_source
from edgeinfer.server import chat
from edgeinfer.server.admin import admin
from edgeinfer.server.decoding import (
    DecodeBudget, check_image_count, decode_budget_bytes, decode_executor, decode_one, prepare_refs,
)
from edgeinfer.server.errors import (
    AuthenticationError, BodyTooLarge, InvalidParam, ModelNotReady, error_payload, error_response,
    install_error_handlers,
)
from edgeinfer.server.images import ImageSourcePolicy
from edgeinfer.server.metrics import ServerMetrics
from edgeinfer.server.schemas import (
    BatchRequest, BatchResponse, ChatCompletion, ChatCompletionRequest, ErrorResponse, Health, ModelCard,
    ModelList, Readiness, VQAResponse,
)
from edgeinfer.server.settings import ServerSettings
from edgeinfer.server.throttle import AdmissionGovernor

log = logging.getLogger("edgeinfer.server")
T = TypeVar("T")
_CLIENT_LEFT = mapping_for(RequestCancelled).http_status  # counted in the metrics, never sent

# Paths that need the API key when the server has one; it is checked before the body is read.
PROTECTED_PREFIXES = ("/v1/", "/metrics", "/sleep", "/wake_up", "/is_sleeping", "/admin/")
KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/vqa", "/v1/models",
                         "/health", "/ready", "/metrics", "/openapi.json", "/docs",
                         "/sleep", "/wake_up", "/is_sleeping", "/admin/cache", "/admin/cache/clear",
                         "/admin/cache/verify"})
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description} for status, description in (
        (400, "Malformed request (invalid JSON, bad base64, unsupported field value)"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body or image file over its size limit"),
        (422, "Wrong field types, or an image refused by preflight (the limit is named)"),
        (503, "Busy (queue full) or not ready; see Retry-After"),
        (504, "The request ran past its deadline"),
    )
}


# --------------------------------------------------------------------------- runtime


class Runtime:
    """What the lifespan owns: the engine once loaded, the image rules, the daemon's state."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.state: Literal["loading", "ready", "failed", "draining"] = "loading"
        self.engine: AsyncEngine | None = None
        self.rules: ImageRules | None = None
        self.decoder: DecodeBudget | None = None
        self._drain: asyncio.Task[int] | None = None
        self.error: str | None = None
        self.started = int(time.time())
        self.policy = ImageSourcePolicy(allow_remote=settings.allow_remote_images,
                                        remote_timeout_s=settings.remote_image_timeout_s,
                                        allowed_local_dir=settings.allowed_local_dir)
        self.governor = AdmissionGovernor(settings.profile.power, settings.server, settings.board_root)

    def load(self) -> None:
        """Blocking: load the checkpoint, derive the image rules, start the engine thread."""
        from edgeinfer.engine.engine import Engine

        settings = self.settings
        engine = Engine.load(settings.model_dir, profile=settings.profile, backend=settings.backend,
                             config=settings.engine_config)
        limits = engine.adapter.image_limits()
        self.rules = ImageRules.from_profile(settings.profile.images, limits.get("max_side"),
                                             limits.get("max_pixels"), limits.get("min_side"))
        server = settings.server
        self.decoder = DecodeBudget(decode_budget_bytes(settings.profile, self.rules),
                                    settings.profile.memory.available_floor_mb * 2**20,
                                    max_waiting=server.max_concurrent + server.max_queue,
                                    executor=decode_executor())
        self.engine = AsyncEngine(engine, max_concurrent=server.max_concurrent, max_queue=server.max_queue,
                                  idle_sleep_s=server.idle_sleep_s, idle_sleep_level=server.idle_sleep_level).start()
        if self.state == "draining":  # shut down while loading: nobody will use it
            self.engine.close()
            return
        freeze_start_up_objects()
        self.state = "ready"

    def require_engine(self) -> AsyncEngine:
        if self.state == "ready" and self.engine is not None:
            return self.engine
        detail = {"loading": "the model is still loading", "draining": "the server is shutting down",
                  "failed": f"the model failed to load: {self.error}"}[self.state]
        raise ModelNotReady(f"{detail}; see GET /ready")

    def begin_shutdown(self) -> None:
        """Take no new requests; give those in flight the grace period, then end them with
        503 (queued) or an error event (streaming). Call on the event loop; idempotent."""
        if self._drain is not None:
            return
        self.state = "draining"
        if self.engine is not None:
            self._drain = asyncio.ensure_future(self.engine.drain(self.settings.server.shutdown_grace_s))

    async def shutdown(self) -> None:
        self.begin_shutdown()
        if self.engine is not None and self._drain is not None:
            ended = await self._drain
            if ended:
                log.warning("ended %d requests still in flight after the shutdown grace period", ended)
            await asyncio.to_thread(self.engine.close, 30.0)  # the engine flushes its KV tiers
        if self.decoder is not None:
            self.decoder.close()


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_engine(runtime: RuntimeDep) -> AsyncEngine:
    return runtime.require_engine()


EngineDep = Annotated[AsyncEngine, Depends(get_engine)]


def get_metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


MetricsDep = Annotated[ServerMetrics, Depends(get_metrics)]

_bearer = HTTPBearer(auto_error=False, description="The server's API key, when it was started with one.")


def require_api_key(request: Request,
                    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """The key check as a dependency, so /docs shows the scheme; :class:`ApiKeyMiddleware`
    has already made the same check before the body was read."""
    check_api_key(get_runtime(request).settings.api_key, credentials.credentials if credentials else None,
                  request.headers.get("x-api-key"))


def check_api_key(expected: str | None, bearer: str | None, header_key: str | None) -> None:
    if expected is None:
        return
    given = bearer or header_key
    if not given:
        raise AuthenticationError("missing API key: send the header 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise AuthenticationError("invalid API key")


def bearer_token(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


# --------------------------------------------------------------------------- middleware


class ApiKeyMiddleware:
    """401 before the body is read, for the protected paths, when the server has a key."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            try:
                check_api_key(self.api_key, bearer_token(headers.get("authorization")), headers.get("x-api-key"))
            except AuthenticationError as error:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: by Content-Length before reading, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(BodyTooLarge(int(declared), self.max_bytes))(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # An HTTPException passes through FastAPI's body parsing as it is.
                raise HTTPException(413, BodyTooLarge(f"over {received}", self.max_bytes).message)
            return message

        await self.app(scope, limited, send)


class RequestMetricsMiddleware:
    """Counts every answer by endpoint and status; a handler may override the status
    (``request.state.status``) for a stream that failed or was left after its headers."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording)
        except asyncio.CancelledError:
            status = status or _CLIENT_LEFT
            raise
        except Exception:
            status = status or 500
            raise
        finally:
            override = scope.get("state", {}).get("status")
            endpoint = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
            self.metrics.requests.labels(endpoint, str(override or status or _CLIENT_LEFT)).inc()


# --------------------------------------------------------------------------- helpers


class CancellingStream(StreamingResponse):
    """A stream that cancels its request however the response ends, even when the client
    left before the body iterator ever started (then the iterator's own cleanup never runs)."""

    def __init__(self, handle: RequestHandle, content: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()  # a no-op once the answer is complete


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], handles: list[RequestHandle]) -> T:
    """Await ``work``; if the client goes away first (or we are cancelled), cancel ``handles``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise RequestCancelled("the client closed the connection; generation cancelled")
    finally:
        for pending in (task, watcher):
            pending.cancel()
        if not task.done() or task.cancelled():
            for handle in handles:
                handle.cancel()


async def _admitted_result(handle: RequestHandle) -> Completion:
    await handle.admitted()
    return await handle.result()


@contextmanager
def counting_rejections(metrics: ServerMetrics) -> Iterator[None]:
    """Count the preflight refusals raised inside, by reason."""
    try:
        yield
    except PreflightError as error:
        metrics.preflight_rejections.labels(error.reason).inc()
        raise


def _observe(request: Request, metrics: ServerMetrics) -> tuple[Callable[[Completion], None],
                                                                 Callable[[EdgeInferError], None]]:
    def done(completion: Completion) -> None:
        metrics.observe(completion)

    def failed(error: EdgeInferError) -> None:
        request.state.status = http_status_for(error)

    return done, failed


# --------------------------------------------------------------------------- routes

api = APIRouter(dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)


@api.post("/v1/chat/completions", response_model=ChatCompletion, summary="Chat about images (OpenAI-compatible)",
          responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                           "description": "A chat.completion, or with stream=true an SSE stream of "
                                          "chat.completion.chunk events ending with 'data: [DONE]'"}})
async def chat_completions(body: ChatCompletionRequest, request: Request, runtime: RuntimeDep, engine: EngineDep,
                           metrics: MetricsDep) -> Any:
    settings = runtime.settings
    # Every check before admission: a request that can never fit gets its 4xx however busy the server is.
    generation, reports = await _prepare_item(body, runtime, metrics, engine)
    handle = engine.submit(generation)
    await unless_disconnected(request, handle.admitted(), [handle])
    done, failed = _observe(request, metrics)
    if body.stream:
        meta = chat.StreamMeta(chat.new_id(), settings.served_model, int(time.time()), reports,
                               bool(body.stream_options and body.stream_options.include_usage))
        return CancellingStream(handle, chat.sse_stream(handle, meta, done, failed), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    completion = await unless_disconnected(request, handle.result(), [handle])
    done(completion)
    return chat.chat_completion(completion, reports, settings.served_model)


@api.post("/v1/chat/completions/batch", response_model=BatchResponse,
          summary="Several chats answered together (each item answered or refused on its own)")
async def chat_batch(body: BatchRequest, request: Request, runtime: RuntimeDep, engine: EngineDep,
                     metrics: MetricsDep) -> BatchResponse:
    settings = runtime.settings
    if len(body.requests) > engine.capacity:  # counted before any item is looked at
        raise RequestError(f"a batch of {len(body.requests)} requests is over the server's capacity of "
                           f"{engine.capacity} (max_concurrent {engine.max_concurrent} + max_queue "
                           f"{engine.max_queue}); send at most {engine.capacity} per batch")
    for i, item in enumerate(body.requests):
        if item.stream:
            raise InvalidParam(f"requests[{i}].stream: a batch is answered whole and cannot stream; "
                                    f"use /v1/chat/completions for streaming", f"requests[{i}].stream")
    prepared_items = await asyncio.gather(*(_prepare_item(item, runtime, metrics, engine) for item in body.requests),
                                          return_exceptions=True)
    accepted = [(i, p) for i, p in enumerate(prepared_items) if not isinstance(p, BaseException)]
    handles = engine.submit_many([p[0] for _, p in accepted])
    outcomes = await unless_disconnected(
        request, asyncio.gather(*(_admitted_result(h) for h in handles), return_exceptions=True), handles)
    done, _ = _observe(request, metrics)
    data: list[ChatCompletion | ErrorResponse] = [_item_error(p) for p in prepared_items]  # type: ignore[misc]
    for (i, (_, reports)), outcome in zip(accepted, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            data[i] = _item_error(outcome)
        else:
            done(outcome)
            data[i] = chat.chat_completion(outcome, reports, settings.served_model)
    return BatchResponse(data=data)


async def _prepare_item(item: ChatCompletionRequest, runtime: Runtime, metrics: ServerMetrics,
                        engine: AsyncEngine) -> tuple[GenerationRequest, list]:
    """One chat checked completely, cheapest checks first; the engine thread is never used."""
    settings = runtime.settings
    assert runtime.rules is not None
    chat.check_unsupported(item, settings.served_model)
    parsed = chat.parse_chat(item, settings.default_max_tokens)
    assert runtime.decoder is not None
    engine.check_text_bounds(chat.generation_request(parsed, [], settings.server.request_timeout_s))
    with counting_rejections(metrics):
        check_image_count(len(parsed.images), runtime.rules)
        prepared = await prepare_refs(parsed.images, runtime.rules, item.on_oversize, runtime.policy,
                                      runtime.decoder)
    request = await engine.prepare(chat.generation_request(parsed, prepared, settings.server.request_timeout_s))
    return request, [p.report for p in prepared]


def _item_error(outcome: Any) -> Any:
    if not isinstance(outcome, BaseException):
        return None
    if not isinstance(outcome, EdgeInferError):
        raise outcome  # a bug: answered 500 by the error handler
    return ErrorResponse.model_validate(error_payload(outcome))


@api.post("/v1/vqa", response_model=VQAResponse, summary="One image and one question, as a multipart form")
async def vqa(
    request: Request, runtime: RuntimeDep, engine: EngineDep, metrics: MetricsDep,
    image: Annotated[UploadFile, File(description="The image file (JPEG, PNG, WebP, BMP, GIF, TIFF).")],
    question: Annotated[str, Form(min_length=1, description="The question about the image.")],
    max_tokens: Annotated[int, Form(ge=1, le=2**31)] = 64,
    temperature: Annotated[float, Form(ge=0.0, le=2.0)] = 0.0,
    seed: Annotated[int | None, Form(ge=0, le=2**63 - 1)] = None,
    on_oversize: Annotated[Literal["reject", "fit"], Form()] = "reject",
) -> VQAResponse:
    settings = runtime.settings
    rules, decoder = runtime.rules, runtime.decoder
    assert rules is not None and decoder is not None
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed)
    generation = GenerationRequest(question, (), sampling, settings.server.request_timeout_s)
    engine.check_text_bounds(generation)
    with counting_rejections(metrics):
        data, _ = await run_in_threadpool(read_image_source, image.file, rules.max_file_bytes, name="image")
        prepared = await decode_one(data, rules, on_oversize, "image", decoder)
    handle = engine.submit(await engine.prepare(dataclasses.replace(generation, images=(prepared,))))
    completion = await unless_disconnected(request, _admitted_result(handle), [handle])
    metrics.observe(completion)
    return VQAResponse(answer=completion.result.text, finish_reason=completion.result.finish_reason,
                       model=settings.served_model, usage=chat.usage_of(completion),
                       edgeinfer=chat.info_of([prepared.report], completion))


@api.get("/v1/models", response_model=ModelList, summary="The one model this server serves")
async def models(runtime: RuntimeDep) -> ModelList:
    return ModelList(data=[ModelCard(id=runtime.settings.served_model, created=runtime.started)])


@api.get("/metrics", summary="Prometheus metrics", response_class=Response,
         responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
def metrics_endpoint(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


probes = APIRouter()


@probes.get("/health", response_model=Health, summary="The process is alive")
async def health(runtime: RuntimeDep) -> Health:
    engine, throttle = runtime.engine, runtime.governor.state
    return Health(sleeping=engine is not None and engine.is_sleeping, throttled=throttle.throttled,
                  throttle_reasons=list(throttle.reasons))


@probes.get("/ready", response_model=Readiness, summary="The model is loaded and requests are taken",
            responses={503: {"model": ErrorResponse, "description": "Loading, failed, or shutting down"}})
async def ready(runtime: RuntimeDep) -> Readiness:
    runtime.require_engine()
    return Readiness(model=runtime.settings.served_model)


# --------------------------------------------------------------------------- the app


def create_app(settings: ServerSettings,
               on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The daemon's app. ``on_load_failure`` is told when the model cannot be loaded
    (the CLI uses it to exit non-zero); the app itself keeps answering /health."""
    runtime = Runtime(settings)
    metrics = ServerMetrics(lambda: runtime.engine, settings.served_model, lambda: runtime.decoder,
                            lambda: runtime.governor.state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(runtime, on_load_failure))
        governor = asyncio.create_task(runtime.governor.run(lambda: runtime.engine)) \
            if settings.profile.power.enabled else None
        try:
            yield
        finally:
            if governor is not None:
                governor.cancel()
            if not loader.done():
                log.warning("shutting down while the model is still loading")
            await runtime.shutdown()

    app = FastAPI(title="edgeinfer", version=edgeinfer.__version__, lifespan=lifespan,
                  summary="OpenAI-compatible vision-language inference on the device",
                  description="See docs/server.md for errors, limits and metrics.")
    app.state.runtime = runtime
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(probes)
    app.include_router(api)
    app.include_router(admin, dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.server.max_body_mb * 2**20)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app


async def _load(runtime: Runtime, on_failure: Callable[[BaseException], None] | None) -> None:
    started = time.perf_counter()
    try:
        await asyncio.to_thread(runtime.load)
    except Exception as error:
        runtime.state, runtime.error = "failed", str(error)
        log.error("model %s failed to load: %s", runtime.settings.model_dir, error)
        if on_failure is not None:
            on_failure(error)
        return
    log.info("model %s ready in %.1f s (profile %s)", runtime.settings.served_model,
             time.perf_counter() - started, runtime.settings.profile.name)
