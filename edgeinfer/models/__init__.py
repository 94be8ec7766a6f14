"""VLM families: one adapter each, plus our compact decoder and the checkpoint loader."""

from edgeinfer.models.registry import adapter_for, supported_architectures

__all__ = ["adapter_for", "supported_architectures"]
