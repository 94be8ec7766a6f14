"""Requests, sequences, the scheduler, sampling and the generation loop."""

from edgeinfer.engine.engine import Engine, EngineConfig, GenerationResult
from edgeinfer.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "SamplingParams"]
