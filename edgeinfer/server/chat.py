"""From wire requests to engine requests, and from engine results to wire responses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from edgeinfer.engine.async_engine import Completion, GenerationRequest, RequestHandle
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError, RequestCancelled
from edgeinfer.preflight import ImageReport, PreparedImage
from edgeinfer.server.errors import InvalidParam, ModelNotFound, error_payload
from edgeinfer.server.images import ImageRef
from edgeinfer.server.schemas import (
    AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, Choice, ChunkChoice,
    Delta, EdgeinferInfo, ImageReportOut, Usage,
)

_UINT64 = 2**64


@dataclass(frozen=True, slots=True)
class ParsedChat:
    """A chat request checked and split: the messages for the template, the image URLs in order."""

    messages: list[dict]
    images: list[ImageRef]
    sampling: SamplingParams


def check_unsupported(body: ChatCompletionRequest, served_model: str) -> None:
    """Refuse, by name, what edgeinfer does not do rather than ignore it."""
    if body.model is not None and body.model != served_model:
        raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {served_model!r} "
                            f"(see GET /v1/models)")
    if body.n not in (None, 1):
        raise InvalidParam(f"n={body.n} is not supported: edgeinfer answers with one choice; "
                           f"send n=1 (or leave it out) and repeat the request with a seed for more", "n")
    if body.logprobs:
        raise InvalidParam("logprobs are not supported; leave it out or send false", "logprobs")


def parse_chat(body: ChatCompletionRequest, default_max_tokens: int) -> ParsedChat:
    messages, images = [], []
    for i, message in enumerate(body.messages):
        messages.append(_template_message(message, i, images))
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise InvalidParam(f"min_tokens={body.min_tokens} is over max_tokens={max_tokens}", "min_tokens")
    sampling = SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=body.min_tokens or 0,
        temperature=0.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
        seed=None if body.seed is None else body.seed % _UINT64, stop=stop, ignore_eos=body.ignore_eos,
        max_thinking_tokens=body.max_thinking_tokens,
    )
    return ParsedChat(messages, images, sampling)


def _template_message(message: ChatMessage, index: int, images: list[ImageRef]) -> dict:
    """OpenAI parts to the template's: text stays, each image_url becomes an image slot."""
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if content is None or isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": content or ""}]}
    if not content:
        return {"role": role, "content": [{"type": "text", "text": ""}]}
    parts = []
    for j, part in enumerate(content):
        if part.type == "text":
            parts.append({"type": "text", "text": part.text})
        else:
            images.append(ImageRef(part.image_url.url, f"messages[{index}].content[{j}]"))
            parts.append({"type": "image"})
    return {"role": role, "content": parts}


def generation_request(chat: ParsedChat, prepared: list[PreparedImage], timeout_s: float) -> GenerationRequest:
    return GenerationRequest(prompt=chat.messages, images=tuple(prepared), sampling=chat.sampling,
                             timeout_s=timeout_s)


# --------------------------------------------------------------------------- responses


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_of(completion: Completion) -> Usage:
    usage = completion.result.usage
    return Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                 total_tokens=usage["total_tokens"])


def info_of(reports: list[ImageReport], completion: Completion | None = None) -> EdgeinferInfo:
    images = [ImageReportOut(**report.to_dict()) for report in reports]
    if completion is None:
        return EdgeinferInfo(images=images)
    result, stats = completion.result, completion.stats
    timings = {**result.timings, "queued_s": stats.queued_s, "server_ttft_s": stats.ttft_s,
               "server_total_s": stats.total_s}
    return EdgeinferInfo(images=images, image_tokens=result.usage.get("image_tokens"), timings=timings,
                         cache=result.cache)


def chat_completion(completion: Completion, reports: list[ImageReport], model: str,
                    request_id: str | None = None) -> ChatCompletion:
    result = completion.result
    return ChatCompletion(
        id=request_id or new_id(), created=int(time.time()), model=model,
        choices=[Choice(index=0, message=AssistantMessage(content=result.text, reasoning_content=result.reasoning), finish_reason=result.finish_reason)],
        usage=usage_of(completion), edgeinfer=info_of(reports, completion),
    )


@dataclass(frozen=True, slots=True)
class StreamMeta:
    request_id: str
    model: str
    created: int
    reports: list[ImageReport]
    include_usage: bool


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def sse_stream(handle: RequestHandle, meta: StreamMeta, on_done: Callable[[Completion], None],
                     on_error: Callable[[EdgeInferError], None]) -> AsyncIterator[str]:
    """The SSE body: a role chunk (with the preflight report), content chunks, a final chunk
    with the finish reason, optionally a usage chunk, then ``data: [DONE]``. An error after
    the headers went out is sent as an ``{"error": ...}`` event before ``[DONE]``."""

    def chunk(delta: Delta, finish: str | None = None, **extra) -> str:
        body = ChatCompletionChunk(id=meta.request_id, created=meta.created, model=meta.model,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish)], **extra)
        data = body.model_dump(exclude_none=True)
        data["choices"][0]["finish_reason"] = finish  # OpenAI sends null until the end
        return sse(data)

    settled = False
    try:
        yield chunk(Delta(role="assistant", content=""), edgeinfer=info_of(meta.reports))
        try:
            async for text in handle.deltas():
                yield chunk(Delta(content=text))
        except EdgeInferError as error:
            settled = True
            on_error(error)
            yield sse(error_payload(error))
            yield sse("[DONE]")
            return
        completion = handle.completion
        assert completion is not None
        settled = True
        on_done(completion)
        yield chunk(Delta(), completion.result.finish_reason, edgeinfer=info_of(meta.reports, completion))
        if meta.include_usage:
            body = ChatCompletionChunk(id=meta.request_id, created=meta.created, model=meta.model, choices=[],
                                       usage=usage_of(completion))
            yield sse(body.model_dump(exclude_none=True))
        yield sse("[DONE]")
    finally:
        handle.cancel()  # a no-op once finished; frees the blocks of a stream left early
        if not settled:
            on_error(RequestCancelled("the client left the stream; generation cancelled"))
