"""Jetson decode projected from a measured share of the byte roofline.

Decode is bound by memory bandwidth, so a board's decode rate is projected as the share of
its own byte roofline the measuring GPU reached, times the board's bandwidth, over the
bytes a decode step reads per token:

    projected tok/s = share × board bandwidth / (bytes per step / batch)

These are projections, never measurements: a board's achievable share is usually lower
than a data-centre GPU's (fewer SMs to hide latency, LPDDR5 rather than HBM, lower clocks
under a power mode).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Board:
    name: str
    memory_gb: int
    bandwidth_gbs: float  # peak DRAM bandwidth, as its maker publishes it
    source: str


BOARDS = (
    Board("Jetson AGX Thor", 128, 273.0, "NVIDIA Jetson AGX Thor Developer Kit specifications (2025)"),
    Board("Jetson AGX Orin 64 GB", 64, 204.8, "NVIDIA Jetson AGX Orin Series Data Sheet"),
    Board("Jetson Orin NX 16 GB", 16, 102.4, "NVIDIA Jetson Orin NX Series Data Sheet"),
    Board("Jetson Orin Nano 8 GB Super", 8, 102.0,
          "NVIDIA Jetson Orin Nano Super Developer Kit specifications (JetPack 6.1, MAXN SUPER, Dec 2024)"),
    Board("Jetson Orin Nano 8 GB (original)", 8, 68.0, "NVIDIA Jetson Orin Nano Series Data Sheet"),
)


def projection_label(gpu: str | None) -> str:
    """What every projected figure says it is."""
    return f"projected from the {gpu or 'measuring GPU'}'s measured share of its byte roofline, not measured on the board"


def projected_tok_s(share: float, bandwidth_gbs: float, step_bytes: float, batch: int) -> float:
    """Decode tokens/s of a step reading ``step_bytes`` for ``batch`` sequences at ``bandwidth_gbs``,
    reaching ``share`` of its roofline."""
    return share * bandwidth_gbs * 1e9 * batch / step_bytes


def projection(rooflines: dict[str, dict[int, dict[str, float]]], boards: tuple[Board, ...] = BOARDS) -> list[dict]:
    """One row per board and engine: the projected decode tokens/s per batch size. ``rooflines``
    maps an engine to its per-batch ``fraction`` (share reached) and ``step_bytes``."""
    return [{"board": board.name, "memory_gb": board.memory_gb, "bandwidth_gbs": board.bandwidth_gbs,
             "source": board.source, "engine": engine,
             "tok_s": {batch: projected_tok_s(row["fraction"], board.bandwidth_gbs, row["step_bytes"], batch)
                       for batch, row in per_batch.items()}}
            for board in boards for engine, per_batch in rooflines.items()]
