"""Wire models of the HTTP API: what clients send and get back, OpenAI-shaped.

These are separate from the engine's own types (``SamplingParams``,
``GenerationResult``); ``edgeinfer.server.chat`` translates between the two. Fields
OpenAI defines that change the output and that edgeinfer does not implement are
accepted only at their neutral value, so nothing is ignored silently; unknown fields
are refused. Types are strict: ``"stream": "yes"``, ``"max_tokens": true`` or ``"5"`` are
422, never coerced. Text must be valid Unicode: a lone surrogate (``"\\ud800"``, which
JSON can escape but UTF-8 cannot carry) is 422 ``invalid_text``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 4
# The most requests one batch may name, counted before any of them is validated: validating
# thousands of items would hold the event loop for seconds. (The server's capacity, usually
# much lower, is checked after.)
MAX_BATCH_ITEMS = 256


INVALID_TEXT = "invalid_text"


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(INVALID_TEXT, "text is not valid Unicode: {detail}; send UTF-8 text",
                                  {"detail": f"{exc.reason} at character {exc.start}"}) from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Wire):
    url: Text = Field(description="data:image/...;base64,<data> URI; http(s):// only with --allow-remote-images; "
                                 "file:// only under --allowed-local-dir.")
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="Accepted for compatibility; the model's processor sets the resolution.")


class TextPart(_Wire):
    type: Literal["text"]
    text: Text


class ImagePart(_Wire):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = Field(None, description="Accepted for compatibility; not shown to the model.")


class StreamOptions(_Wire):
    include_usage: bool = False


class ChatCompletionRequest(_Wire):
    """``POST /v1/chat/completions``. Defaults differ from OpenAI's in one place:
    ``temperature`` is 0 (greedy), so a device answers the same question the same way."""

    model: Text | None = Field(None, description="The id from /v1/models; may be left out.")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX,
                                              description="Wins over max_tokens when both are given.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: Text | list[Text] | None = Field(None, description=f"Up to {MAX_STOP_STRINGS} stop strings.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, description="Only 1 is supported.")
    on_oversize: Literal["reject", "fit"] = Field(
        "reject", description="An image over the size limits: 'reject' (422, the limit named) or 'fit' "
                              "(downscaled; the response's edgeinfer.images says from what to what).")
    # Extensions vLLM also accepts:
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    max_thinking_tokens: int | None = Field(
        None, ge=0, le=INT64_MAX, description="Models that think: the span closes after this many thinking "
                                              "tokens and the answer follows (reasoning_content holds them).")
    # OpenAI fields accepted only at their neutral value:
    logprobs: bool | None = Field(None, description="Only false is supported.")
    user: Text | None = Field(None, description="Accepted for compatibility; not used.")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value


class BatchRequest(_Wire):
    """``POST /v1/chat/completions/batch``: several chats answered together (none may stream)."""

    requests: list[ChatCompletionRequest] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)

    @field_validator("requests", mode="before")
    @classmethod
    def _count_first(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_BATCH_ITEMS:
            raise PydanticCustomError("too_long", "a batch holds at most {limit} requests, this one has {count}",
                                      {"limit": MAX_BATCH_ITEMS, "count": len(value)})
        return value


# --------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ImageReportOut(BaseModel):
    """What preflight did to one image."""

    source: str
    format: str
    original_size: list[int]
    final_size: list[int]
    action: Literal["none", "downscaled"]
    conversions: list[str]
    fitted_to: str | None = None


class EdgeinferInfo(BaseModel):
    """The ``edgeinfer`` extension object of a response."""

    images: list[ImageReportOut] = []
    image_tokens: int | None = None
    timings: dict[str, float | None] = {}
    cache: dict[str, int] = {}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    reasoning_content: str | None = None  # models that think: their thinking, apart from the answer


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    edgeinfer: EdgeinferInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    edgeinfer: EdgeinferInfo | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    edgeinfer: dict[str, Any] | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class BatchResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[ChatCompletion | ErrorResponse]


class VQAResponse(BaseModel):
    answer: str
    finish_reason: str
    model: str
    usage: Usage
    edgeinfer: EdgeinferInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edgeinfer"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    sleeping: bool = False  # the engine released its memory; the next request wakes it
    throttled: bool = False  # the board is at its power or heat limit: admission is lowered
    throttle_reasons: list[str] = []


class Readiness(BaseModel):
    """200 from /ready; loading, a failed load and shutting down answer 503 (model_not_ready)."""

    status: Literal["ready"] = "ready"
    model: str
