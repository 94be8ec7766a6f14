"""Backends run the two engines (vision, decoder) of the engine contract."""

from edgeinfer.backends.base import BACKENDS, DecoderEngine, VisionEngine, resolve_backend

__all__ = ["BACKENDS", "DecoderEngine", "VisionEngine", "resolve_backend"]
