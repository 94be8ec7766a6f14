"""Power- and heat-aware admission: while the board is at its limit, admit less.

The profile's ``power`` section names the limits (:class:`~edgeinfer.profiles.PowerLimits`).
Every ``check_every_s`` the board is read (:func:`~edgeinfer.power.read_power_snapshot`);
at a limit the engine's ``max_concurrent`` and ``max_queue`` fall to the throttled values
and Retry-After is stretched, and once no limit is reached the profile's values return.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.engine.async_engine import AsyncEngine
from edgeinfer.power import limits_reached, read_power_snapshot
from edgeinfer.profiles import PowerLimits, ServerConfig

log = logging.getLogger("edgeinfer.server")


@dataclass(frozen=True, slots=True)
class ThrottleState:
    throttled: bool = False
    reasons: tuple[str, ...] = ()
    max_concurrent: int = 0
    max_queue: int = 0


class AdmissionGovernor:
    """Reads the board under ``root`` and sets the engine's admission limits to match."""

    def __init__(self, limits: PowerLimits, server: ServerConfig, root: Path = Path("/")) -> None:
        self.limits = limits
        self.server = server
        self.root = root
        self.state = ThrottleState(False, (), server.max_concurrent, server.max_queue)

    def reasons(self) -> tuple[str, ...]:
        """The limits the board is at now (a blocking read of sysfs)."""
        limits = self.limits
        snapshot = read_power_snapshot(self.root, use_jtop=False)
        return limits_reached(snapshot, thermal_zone=limits.thermal_zone, thermal_limit_c=limits.thermal_limit_c,
                              power_budget_w=limits.power_budget_w, clock_cap_check=limits.clock_cap_check)

    def apply(self, engine: AsyncEngine, reasons: tuple[str, ...]) -> ThrottleState:
        limits, server = self.limits, self.server
        if reasons:
            state = ThrottleState(True, reasons, limits.throttled_max_concurrent, limits.throttled_max_queue)
            engine.set_limits(state.max_concurrent, state.max_queue, limits.retry_factor)
        else:
            state = ThrottleState(False, (), server.max_concurrent, server.max_queue)
            engine.set_limits(state.max_concurrent, state.max_queue, 1.0)
        if state.throttled != self.state.throttled:
            log.warning("board at its limit (%s): admission lowered to %d running, %d queued", "; ".join(reasons),
                        state.max_concurrent, state.max_queue) if state.throttled else \
                log.info("board back under its limits: admission restored")
        self.state = state
        return state

    async def run(self, engine_of) -> None:
        """Check forever (cancel to stop); ``engine_of()`` is the engine once loaded, else None."""
        while True:
            engine = engine_of()
            if engine is not None:
                try:
                    self.apply(engine, await asyncio.to_thread(self.reasons))
                except Exception:  # a board file that changed under us: try again next time
                    log.exception("reading the board's limits failed")
            await asyncio.sleep(self.limits.check_every_s)
