"""Which family adapter serves which ``config.architectures`` entry."""

from __future__ import annotations

from edgeinfer.models.base import FamilyAdapter


def _adapters() -> list[type[FamilyAdapter]]:
    from edgeinfer.models.gemma3 import Gemma3Adapter
    from edgeinfer.models.idefics3 import Idefics3Adapter, SmolVLMAdapter
    from edgeinfer.models.llava import LlavaAdapter, LlavaNextAdapter
    from edgeinfer.models.qwen2_vl import Qwen2VLAdapter, Qwen25VLAdapter

    return [Idefics3Adapter, SmolVLMAdapter, Qwen2VLAdapter, Qwen25VLAdapter, LlavaAdapter, LlavaNextAdapter,
            Gemma3Adapter]


def supported_architectures() -> list[str]:
    return sorted(a for cls in _adapters() for a in cls.architectures)


def adapter_for(architectures: list[str]) -> type[FamilyAdapter] | None:
    for cls in _adapters():
        if any(a in cls.architectures for a in architectures):
            return cls
    return None
