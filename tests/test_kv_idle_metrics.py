"""An idle engine's KV metrics settle: blocks written through to disk after the last request stop
being reported as ``storing`` without waiting for another request."""

from __future__ import annotations

import asyncio
import time

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.engine.async_engine import AsyncEngine, GenerationRequest
from tests.conftest import noise_image


def device_blocks(engine: AsyncEngine, state: str) -> int:
    return engine.snapshot.kv.tiers["device"].blocks[state]


def settled(engine: AsyncEngine) -> bool:
    """The published snapshot is one taken after the request (its image was encoded) with nothing
    running and nothing storing."""
    after = engine.snapshot.counters.get("vision_runs") == 1
    return after and device_blocks(engine, "running") == 0 and device_blocks(engine, "storing") == 0


def test_storing_blocks_settle_on_an_idle_engine(checkpoint, tmp_path):
    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=64, disk_tier_mb=4,
                                                                     disk_dir=str(tmp_path)))
    served = AsyncEngine(engine, max_concurrent=1, max_queue=1).start()
    request = GenerationRequest("what is in the image ?", (noise_image(128, 96, seed=1),),
                                SamplingParams(max_new_tokens=4, min_new_tokens=4))
    try:
        asyncio.run(served.generate(request))
        deadline = time.monotonic() + 10
        while not settled(served) and time.monotonic() < deadline:
            time.sleep(0.05)
        blocks = served.snapshot.kv.tiers["device"].blocks
        assert settled(served), f"an idle engine still reports {blocks}"
        assert served.snapshot.kv.persisted_blocks > 0  # the write-through did happen, and was counted
    finally:
        served.close()
        engine.close()
