"""From a chat (text + images) to token ids, positions and merged embeddings."""

from __future__ import annotations

from typing import Any

import torch

from edgeinfer.errors import RequestError
from edgeinfer.models.base import FamilyAdapter, ImageInputs, PromptLayout

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
    found = sum(1 for i in ids if i == adapter.image_token_id)
    if found != expected:
        raise RequestError(f"tokenized prompt has {found} image tokens where the images need {expected}")
    return adapter.layout(ids, images)


def merge_embeddings(text_embeds: torch.Tensor, token_ids: list[int], image_token_id: int,
                     image_embeds: list[torch.Tensor]) -> torch.Tensor:
    """Put image embeddings, in order, at the image-token positions of the text embeddings."""
    if not image_embeds:
        return text_embeds
    mask = (torch.tensor(token_ids) == image_token_id).to(text_embeds.device)
    merged = text_embeds.clone()
    merged[mask] = torch.cat(image_embeds).to(merged.dtype)
    return merged
