"""Which family adapter serves which ``config.architectures`` entry."""

from __future__ import annotations

from edgeinfer.models.base import FamilyAdapter


def _adapters() -> list[type[FamilyAdapter]]:
    from edgeinfer.models.gemma3 import Gemma3Adapter
    from edgeinfer.models.gemma4 import Gemma4Adapter
    from edgeinfer.models.idefics3 import Idefics3Adapter, SmolVLMAdapter
    from edgeinfer.models.internvl import InternVLAdapter
    from edgeinfer.models.llava import LlavaAdapter, LlavaNextAdapter
    from edgeinfer.models.qwen2_vl import Qwen2VLAdapter, Qwen25VLAdapter
    from edgeinfer.models.qwen3_vl import Qwen3VLAdapter

    return [Idefics3Adapter, SmolVLMAdapter, Qwen2VLAdapter, Qwen25VLAdapter, Qwen3VLAdapter, LlavaAdapter,
            LlavaNextAdapter, InternVLAdapter, Gemma3Adapter, Gemma4Adapter]


# Architectures known and not run yet, with what they lack. (Gemma 4 variants with features
# not run are refused by their adapter, which names the features.)
NOT_YET_SUPPORTED: dict[str, str] = {}


def not_yet_supported(architectures: list[str]) -> str | None:
    """Why a known architecture is not run yet; None for the rest."""
    return next((NOT_YET_SUPPORTED[a] for a in architectures if a in NOT_YET_SUPPORTED), None)


def supported_architectures() -> list[str]:
    return sorted(a for cls in _adapters() for a in cls.architectures)


def adapter_for(architectures: list[str]) -> type[FamilyAdapter] | None:
    for cls in _adapters():
        if any(a in cls.architectures for a in architectures):
            return cls
    return None
