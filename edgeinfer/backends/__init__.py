"""Backends run the two engines (vision, decoder) of the engine contract; the registry chooses one."""

from edgeinfer.backends.base import DecoderEngine, Engines, VisionEngine

__all__ = ["DecoderEngine", "Engines", "VisionEngine"]
