"""KV metrics: a plain snapshot (``KVManager.metrics()``) and its Prometheus collector.

The snapshot is data only, so the daemon, ``--json`` and the benchmark read the same
numbers. :func:`register_kv_metrics` adds a collector to a registry the caller owns
(never the global one); each scrape takes a fresh snapshot.

Metric names (see ``docs/kv_cache.md`` for how to read them):

- ``edgeinfer_kv_usage_ratio{tier}``: blocks in use over capacity, per tier.
- ``edgeinfer_kv_blocks{tier,state}``: device blocks running / idle / storing / loading /
  free; host and disk blocks idle / preempted / busy / free.
- ``edgeinfer_kv_spill_bytes_total``, ``edgeinfer_kv_restore_bytes_total``,
  ``edgeinfer_kv_persist_bytes_total``; ``edgeinfer_kv_spill_seconds`` and
  ``edgeinfer_kv_restore_seconds`` histograms (submit to completion, per transfer).
- ``edgeinfer_kv_prefix_hit_ratio``: prompt tokens served by the prefix cache over
  tokens looked up; ``edgeinfer_kv_prefix_{lookups,hits}_total``.
- ``edgeinfer_kv_preemptions_total``, ``edgeinfer_kv_recomputes_total`` (blocks that
  failed a checksum or a read), ``edgeinfer_kv_lost_blocks_total``,
  ``edgeinfer_kv_disk_errors_total``.
- ``edgeinfer_kv_transfer_seconds_total`` (worker busy) and
  ``edgeinfer_kv_transfer_wait_seconds_total`` (the engine waited on a transfer).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class Histogram:
    """Cumulative-at-read latency histogram: ``counts[i]`` observations <= ``buckets[i]``, last is +Inf."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.count)

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass(slots=True)
class KVStats:
    """The running counters behind :class:`KVMetrics`."""

    lookups: int = 0
    lookup_tokens: int = 0
    hits: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    recomputes: int = 0  # blocks that failed a checksum or a read and were recomputed
    lost_blocks: int = 0  # blocks of preempted sequences dropped from every tier
    spilled_blocks: int = 0
    restored_blocks: int = 0
    persisted_blocks: int = 0
    spill_bytes: int = 0
    restore_bytes: int = 0
    persist_bytes: int = 0
    disk_errors: int = 0
    floor_events: int = 0
    transfer_s: float = 0.0  # worker seconds spent on spills and restores
    wait_s: float = 0.0  # seconds the engine's thread waited for one
    spill_latency: Histogram = field(default_factory=Histogram)
    restore_latency: Histogram = field(default_factory=Histogram)


@dataclass(frozen=True, slots=True)
class TierUsage:
    capacity_blocks: int
    blocks: dict[str, int]  # state -> blocks
    block_bytes: int

    @classmethod
    def of(cls, capacity: int, blocks: dict[str, int], block_bytes: int) -> TierUsage:
        return cls(capacity, blocks, block_bytes)

    @property
    def used_blocks(self) -> int:
        return self.capacity_blocks - self.blocks.get("free", 0)

    @property
    def usage_ratio(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


@dataclass(frozen=True, slots=True)
class KVMetrics:
    tiers: dict[str, TierUsage]
    codec: str
    spilled_blocks: int
    restored_blocks: int
    persisted_blocks: int
    spill_bytes: int
    restore_bytes: int
    persist_bytes: int
    spill_latency: Histogram
    restore_latency: Histogram
    prefix_lookups: int
    prefix_hits: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    recomputes: int
    lost_blocks: int
    disk_errors: int
    disk_repaired: int
    floor_events: int
    transfer_s: float
    wait_s: float

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    @property
    def hidden_ratio(self) -> float | None:
        """Share of transfer time the engine did not wait for (it ran behind compute)."""
        if self.transfer_s <= 0:
            return None
        return max(0.0, 1.0 - self.wait_s / self.transfer_s)

    def triples(self) -> list[tuple[str, dict[str, str], float]]:
        """The snapshot as (metric name, labels, value), the names of the module docstring."""
        out: list[tuple[str, dict[str, str], float]] = []
        for tier, t in self.tiers.items():
            out.append(("edgeinfer_kv_usage_ratio", {"tier": tier}, t.usage_ratio))
            out += [("edgeinfer_kv_blocks", {"tier": tier, "state": state}, n) for state, n in t.blocks.items()]
        for name in ("spill_bytes", "restore_bytes", "persist_bytes", "preemptions", "recomputes",
                     "lost_blocks", "disk_errors"):
            out.append((f"edgeinfer_kv_{name}_total", {}, getattr(self, name)))
        out += [("edgeinfer_kv_prefix_lookups_total", {}, self.prefix_lookups),
                ("edgeinfer_kv_prefix_hits_total", {}, self.prefix_hits),
                ("edgeinfer_kv_prefix_hit_ratio", {}, self.prefix_hit_ratio),
                ("edgeinfer_kv_transfer_seconds_total", {}, self.transfer_s),
                ("edgeinfer_kv_transfer_wait_seconds_total", {}, self.wait_s)]
        for name, h in (("spill", self.spill_latency), ("restore", self.restore_latency)):
            out += [(f"edgeinfer_kv_{name}_seconds_bucket", {"le": le}, n) for le, n in h.cumulative()]
            out += [(f"edgeinfer_kv_{name}_seconds_sum", {}, h.total), (f"edgeinfer_kv_{name}_seconds_count", {}, h.count)]
        return out

    def __iter__(self):
        return iter(self.triples())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tiers"] = {name: {"capacity_blocks": t.capacity_blocks, "blocks": dict(t.blocks),
                               "usage_ratio": t.usage_ratio} for name, t in self.tiers.items()}
        for name in ("spill_latency", "restore_latency"):
            h: Histogram = getattr(self, name)
            out[name] = {"count": h.count, "sum_s": h.total, "buckets": dict(h.cumulative())}
        out["prefix_hit_ratio"] = self.prefix_hit_ratio
        out["hidden_ratio"] = self.hidden_ratio
        return out


def register_kv_metrics(registry, snapshot: Callable[[], KVMetrics]):
    """Add a collector of ``snapshot()`` to a prometheus_client ``CollectorRegistry``; returns it."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    class KVCollector:
        def collect(self):
            m = snapshot()
            usage = GaugeMetricFamily("edgeinfer_kv_usage_ratio", "KV blocks in use over capacity", labels=["tier"])
            blocks = GaugeMetricFamily("edgeinfer_kv_blocks", "KV blocks by tier and state", labels=["tier", "state"])
            for tier, t in m.tiers.items():
                usage.add_metric([tier], t.usage_ratio)
                for state, n in t.blocks.items():
                    blocks.add_metric([tier, state], n)
            yield usage
            yield blocks
            for name, value, help_text in (
                ("spill_bytes", m.spill_bytes, "Bytes spilled from a faster KV tier to a slower one"),
                ("restore_bytes", m.restore_bytes, "Bytes restored into the device KV pool"),
                ("persist_bytes", m.persist_bytes, "Bytes written through to the disk tier"),
                ("prefix_lookups", m.prefix_lookups, "Prompts looked up in the prefix cache"),
                ("prefix_hits", m.prefix_hits, "Prompts that reused at least one cached token"),
                ("preemptions", m.preemptions, "Running sequences spilled to make room"),
                ("recomputes", m.recomputes, "KV blocks recomputed after a checksum or read failure"),
                ("lost_blocks", m.lost_blocks, "Blocks of preempted sequences dropped from every tier"),
                ("disk_errors", m.disk_errors, "Failed writes to the disk tier"),
                ("transfer_seconds", m.transfer_s, "Seconds the spill worker spent moving blocks"),
                ("transfer_wait_seconds", m.wait_s, "Seconds the engine waited for a transfer"),
            ):
                yield CounterMetricFamily(f"edgeinfer_kv_{name}", help_text, value=value)
            ratio = GaugeMetricFamily("edgeinfer_kv_prefix_hit_ratio", "Prompt tokens served by the prefix cache "
                                      "over tokens looked up")
            ratio.add_metric([], m.prefix_hit_ratio)
            yield ratio
            for name, h, help_text in (("spill_seconds", m.spill_latency, "KV spill latency per transfer"),
                                       ("restore_seconds", m.restore_latency, "KV restore latency per transfer")):
                yield HistogramMetricFamily(f"edgeinfer_kv_{name}", help_text, buckets=h.cumulative(),
                                            sum_value=h.total)

    collector = KVCollector()
    registry.register(collector)
    return collector
