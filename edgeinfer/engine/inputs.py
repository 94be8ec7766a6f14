"""From a chat (text + images) to a sequence: chat → text → token layout → merged embeddings.

:meth:`Inputs.prepare` renders the chat, expands each image's placeholder, tokenizes, lays
the tokens out (positions) and checks the request against the context and memory limits,
all before any vision work. :meth:`Inputs.sequence` then merges the image embeddings into
the text embeddings and builds the :class:`Sequence` the scheduler takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.sampling import SamplingParams, Thinking, open_at_end
from edgeinfer.engine.sampling_rng import fresh_seed
from edgeinfer.engine.sequence import Sequence
from edgeinfer.errors import LimitExceeded, RequestError
from edgeinfer.kv.hashing import ImageSpan, image_spans
from edgeinfer.kv.pool import BlockTable
from edgeinfer.models.base import FamilyAdapter, ImageInputs, PromptLayout
from edgeinfer.models.decoder import widen_embeds
from edgeinfer.models.loader import LoadedModel
from edgeinfer.preflight import check_cost, content_hash, estimate_cost

Message = dict[str, Any]


def user_message(question: str, num_images: int) -> list[Message]:
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def normalize_messages(messages: list[Message]) -> tuple[list[Message], int]:
    """OpenAI-style parts (``image_url``) become template parts (``image``); returns the image count."""
    out, images = [], 0
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise RequestError("each message must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, str) or content is None:
            out.append({"role": message["role"], "content": [{"type": "text", "text": content or ""}]})
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in ("image", "image_url"):
                parts.append({"type": "image"})
                images += 1
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise RequestError(f"unsupported content part type {kind!r}; use 'text' or 'image_url'")
        out.append({"role": message["role"], "content": parts})
    return out, images


def render_chat(adapter: FamilyAdapter, messages: list[Message]) -> str:
    template = adapter.checkpoint.chat_template
    if template is None:
        raise RequestError(f"model {adapter.checkpoint.path.name} has no chat template; send a raw prompt instead")
    return adapter.tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def expand_images(text: str, marker: str, images: list[ImageInputs]) -> str:
    """Replace the n-th image marker with the n-th image's expanded placeholder."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(images):
        raise RequestError(f"prompt has {len(pieces) - 1} image markers but {len(images)} images were given")
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        out += [image.placeholder, piece]
    return "".join(out)


def tokenize(adapter: FamilyAdapter, text: str, images: list[ImageInputs]) -> PromptLayout:
    ids = adapter.tokenizer(text)["input_ids"]
    expected = sum(image.num_tokens for image in images)
    found = ids.count(adapter.image_token_id)  # the id read once: a config attribute costs microseconds a read
    if found != expected:
        raise RequestError(f"tokenized prompt has {found} image tokens where the images need {expected}")
    return adapter.layout(ids, images)


def staged(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """Host ``tensor`` as a copy to ``device`` need not wait for: in page-locked memory where
    ``device`` is a GPU (a copy from pageable memory may wait for the stream's queued work)."""
    return tensor.pin_memory() if device.startswith("cuda") and torch.cuda.is_available() else tensor


def merge_embeddings(text_embeds: torch.Tensor, token_ids: list[int], image_token_id: int,
                     image_embeds: list[torch.Tensor]) -> torch.Tensor:
    """Put image embeddings, in order, at the image-token positions of the text embeddings.

    Image rows wider than the text's carry deepstack additions; the text rows are widened
    with zeros to match (``models.decoder.split_visual_additions``). The positions are found
    on the host, so that nothing here waits for the device (the vision engine may still be at work)."""
    if not image_embeds:
        return text_embeds
    where = staged(torch.tensor([i for i, token in enumerate(token_ids) if token == image_token_id]),
                   str(text_embeds.device))
    merged = widen_embeds(text_embeds, image_embeds[0].shape[-1]).clone()
    merged.index_copy_(0, where.to(merged.device, non_blocking=True), torch.cat(image_embeds).to(merged.dtype))
    return merged


def image_key(image) -> tuple[Any, str]:
    """(PIL image, content hash); accepts a preflight PreparedImage or a PIL image."""
    if hasattr(image, "sha256") and hasattr(image, "image"):
        return image.image, image.sha256
    if not hasattr(image, "tobytes"):
        raise RequestError(f"images must be PIL images or prepared images, got {type(image).__name__}")
    rgb = image.convert("RGB")
    return rgb, content_hash(rgb)


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A request laid out and checked, before any vision work."""

    layout: PromptLayout
    images: tuple[ImageInputs, ...]
    keys: tuple[str, ...]  # each image's content hash: its vision cache key

    @property
    def image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)

    def spans(self) -> tuple[ImageSpan, ...]:
        """Which image each image token shows (the prefix cache keys on it)."""
        return image_spans(self.layout.token_ids, self.layout.image_token_id,
                           [(key, image.num_tokens) for key, image in zip(self.keys, self.images)])


class Inputs:
    """Chat → text → token layout → merged embeddings, for one model.

    It holds the tokenizer and the decoder's shape, never its weights: an engine asleep keeps
    it, so requests are still checked (off the engine thread) while the weights are away."""

    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.adapter = model.adapter
        self.decoder_cfg = model.decoder.cfg
        self.config = config
        self.stop_ids = frozenset(self.adapter.stop_token_ids())
        self.thinking_ids = self.adapter.thinking_token_ids()

    def prepare(self, prompt: str | list[Message], images: Seq[Any], sampling: SamplingParams) -> PreparedPrompt:
        """Render, expand, tokenize and lay out the prompt; refuse it over a limit."""
        messages, markers = (user_message(prompt, len(images)), len(images)) if isinstance(prompt, str) \
            else normalize_messages(prompt)
        if markers != len(images):
            raise RequestError(f"messages reference {markers} images but {len(images)} were given")
        self.check_thinking(sampling)
        keyed = [image_key(image) for image in images]
        processed = [self.adapter.process_image(pil) for pil, _ in keyed]
        text = expand_images(render_chat(self.adapter, messages), self.adapter.image_marker, processed)
        layout = tokenize(self.adapter, text, processed)
        self.check(layout, processed, sampling)
        # The pictures' tensors staged for the vision engine's copies here, off the engine thread in a server.
        device = self.config.device
        processed = [replace(p, tensors={name: staged(t, device) for name, t in p.tensors.items()}) for p in processed]
        return PreparedPrompt(layout, tuple(processed), tuple(key for _, key in keyed))

    def check_thinking(self, sampling: SamplingParams) -> None:
        """A thinking cap needs a model whose tokenizer opens and closes thinking spans."""
        if sampling.max_thinking_tokens is not None and self.thinking_ids is None:
            start, end = self.adapter.thinking_markers
            raise RequestError(f"max_thinking_tokens needs a model with thinking tokens ({start} ... {end}); "
                               f"{self.adapter.checkpoint.path.name} has none")

    def thinking(self, token_ids: list[int], sampling: SamplingParams) -> Thinking | None:
        """The thinking state of a new sequence: open where the prompt ends inside a span."""
        if self.thinking_ids is None:
            return None
        return Thinking(*self.thinking_ids, limit=sampling.max_thinking_tokens,
                        open=open_at_end(token_ids, *self.thinking_ids))

    def check(self, layout: PromptLayout, images: Seq[ImageInputs], sampling: SamplingParams) -> None:
        """Refuse, before any vision work, a request over the context or memory limits."""
        total = len(layout.token_ids) + sampling.max_new_tokens
        if total > self.config.max_context:
            raise LimitExceeded("prompt + max_new_tokens", total, self.config.max_context,
                                "--set runtime.max_context_tokens=N", "context_length")
        image_tokens = sum(p.num_tokens for p in images)
        dtype_bytes = self.config.torch_dtype.itemsize
        estimate = estimate_cost(
            image_tokens, len(layout.token_ids) - image_tokens, sampling.max_new_tokens,
            vision_hidden=self.adapter.vision_hidden,
            vision_layers_tokens_per_image=max((self.adapter.vision_patches(p) for p in images), default=0),
            kv_bytes_per_token=self.decoder_cfg.kv_bytes_per_token * dtype_bytes, dtype_bytes=dtype_bytes)
        check_cost(estimate, self.config.kv_budget_mb * 2**20 + estimate.vision_activation_bytes,
                   self.config.available_floor_mb * 2**20)

    def sequence(self, prompt: PreparedPrompt, image_embeds: list[torch.Tensor], sampling: SamplingParams,
                 embed: Callable[[torch.Tensor], torch.Tensor], vision_reused: int = 0) -> Sequence:
        """The sequence of ``prompt``: text embeddings (``embed``: the decoder engine's, [N] ids ->
        [N, hidden]) with ``image_embeds`` merged at the image tokens."""
        layout = prompt.layout
        ids = staged(torch.tensor(layout.token_ids), self.config.device)
        embeds = merge_embeddings(embed(ids), layout.token_ids, layout.image_token_id, image_embeds)
        stop = self.stop_ids if sampling.stop_token_ids is None else frozenset(sampling.stop_token_ids)
        return Sequence(
            prompt_ids=layout.token_ids, prompt_embeds=embeds, prompt_positions=layout.position_ids,
            next_position=layout.next_position, sampling=sampling,
            stop_token_ids=frozenset() if sampling.ignore_eos else stop,
            block_table=BlockTable(self.config.block_size),
            seed=fresh_seed() if sampling.seed is None else sampling.seed,
            image_tokens=prompt.image_tokens, vision_reused=vision_reused, image_spans=prompt.spans(),
            thinking=self.thinking(layout.token_ids, sampling),
            image_groups=layout.attend_groups,
        )
