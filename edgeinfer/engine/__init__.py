"""Requests, sequences, the scheduler, sampling and the generation loop."""

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import Engine
from edgeinfer.engine.output import GenerationResult
from edgeinfer.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "SamplingParams"]
