"""edgeinfer: vision-language inference on Jetson, CUDA GPUs and CPUs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch and transformers: import it only when asked for.
    if name in ("Engine", "EngineConfig", "GenerationResult", "SamplingParams"):
        from edgeinfer import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "GenerationResult", "SamplingParams", "__version__"]
