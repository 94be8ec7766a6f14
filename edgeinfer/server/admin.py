"""Admin routes, behind the API key like ``/v1``: sleep and wake (vLLM's names), and the
persisted cache.

``POST /sleep?level=1|2`` releases the KV pool and the weights (see
:meth:`~edgeinfer.engine.engine.Engine.sleep`), ``POST /wake_up`` builds them again (a
request does that too), ``GET /is_sleeping`` says which. ``/admin/cache`` reports the cache
folder; ``/admin/cache/clear`` and ``/admin/cache/verify`` first put the engine to sleep at
level 1, which releases its cache folder, and leave it asleep (the next request wakes it).
Every action runs on the engine thread between steps: requests wait for it, none fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from edgeinfer.engine.async_engine import AsyncEngine
from edgeinfer.engine.engine import Engine, SleepLevel
from edgeinfer.kv.inventory import cache_stats, clear_cache, verify_cache


class SleepState(BaseModel):
    is_sleeping: bool
    level: int  # 0 awake, 1 weights in host memory, 2 weights dropped


class SleepAnswer(SleepState):
    seconds: float  # the sleep (or wake) itself
    persisted_blocks: int = 0
    freed_kv_bytes: int = 0
    weights: str = ""


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.runtime.require_engine()


EngineDep = Annotated[AsyncEngine, Depends(_engine)]

# The app includes it behind its API key check (``create_app``).
admin = APIRouter(tags=["admin"])


def _state(engine: Engine) -> dict[str, Any]:
    return {"is_sleeping": engine.is_sleeping, "level": int(engine.sleep_level)}


@admin.post("/sleep", response_model=SleepAnswer, summary="Release the KV pool and the weights until woken")
async def sleep(engine: EngineDep, level: Annotated[int, Query(ge=1, le=2, description=(
        "1: KV freed, weights to host memory (a file on a CPU); 2: weights dropped, reloaded from disk"))] = 1
                ) -> SleepAnswer:
    def run(e: Engine) -> SleepAnswer:
        report = e.sleep(SleepLevel(level))
        return SleepAnswer(**_state(e), seconds=report.seconds, persisted_blocks=report.persisted_blocks,
                           freed_kv_bytes=report.freed_kv_bytes, weights=report.weights)

    return await engine.control(run)


@admin.post("/wake_up", response_model=SleepAnswer, summary="Load the weights and the KV pool again")
async def wake_up(engine: EngineDep) -> SleepAnswer:
    def run(e: Engine) -> SleepAnswer:
        seconds = e.wake_up()
        return SleepAnswer(**_state(e), seconds=seconds)

    return await engine.control(run)


@admin.get("/is_sleeping", response_model=SleepState, summary="Whether the engine sleeps, and how deeply")
async def is_sleeping(engine: EngineDep) -> SleepState:
    return SleepState(is_sleeping=engine.is_sleeping, level=int(getattr(engine.engine, "sleep_level", 0)))


def _cache_root(engine: Engine) -> Path:
    from edgeinfer.kv.disk import default_cache_dir

    folder = engine.config.disk_dir
    return Path(folder).expanduser() if folder else default_cache_dir()


def _live_store(engine: Engine):
    return None if engine.is_sleeping else engine.kv_manager.disk


@admin.get("/admin/cache", summary="The persisted cache: model folders, KV blocks, vision entries")
async def cache(engine: EngineDep, model: Annotated[str | None, Query(max_length=64)] = None) -> dict:
    return await engine.control(lambda e: cache_stats(_cache_root(e), model, live=_live_store(e)).to_dict())


@admin.post("/admin/cache/clear", summary="Remove KV blocks and/or vision entries (the engine sleeps first)")
async def cache_clear(engine: EngineDep, model: Annotated[str | None, Query(max_length=64)] = None,
                      kv: bool = True, vision: bool = True) -> dict:
    def run(e: Engine) -> dict:
        e.sleep(SleepLevel.OFFLOAD)
        return clear_cache(_cache_root(e), model, kv=kv, vision=vision).to_dict()

    return await engine.control(run)


@admin.post("/admin/cache/verify", summary="Check every checksum; remove damaged entries (the engine sleeps first)")
async def cache_verify(engine: EngineDep, model: Annotated[str | None, Query(max_length=64)] = None) -> dict:
    def run(e: Engine) -> dict:
        e.sleep(SleepLevel.OFFLOAD)
        return verify_cache(_cache_root(e), model).to_dict()

    return await engine.control(run)
