"""Prometheus metrics of one app, in its own ``CollectorRegistry`` (never the global one).

Counters and histograms are updated as requests finish; gauges (queue, KV pool,
memory, power and thermal) are read when ``/metrics`` is scraped, from the engine
thread's last published snapshot, never from the engine live.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from edgeinfer.engine.async_engine import AsyncEngine, Completion, metric_triples
from edgeinfer.server.decoding import DecodeBudget

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
POWER_EVERY_S = 5.0


class ServerMetrics:
    def __init__(self, engine: Callable[[], AsyncEngine | None], model: str,
                 decoder: Callable[[], DecodeBudget | None] = lambda: None,
                 throttle: Callable[[], Any] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("edgeinfer_requests", "HTTP requests answered, by endpoint and status "
                                "(499: the client went away first)", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("edgeinfer_time_to_first_token_seconds",
                              "Arrival to first token (includes queueing)", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("edgeinfer_time_per_output_token_seconds",
                              "Mean time per output token after the first", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("edgeinfer_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("edgeinfer_request_queue_seconds", "Arrival to admission into the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("edgeinfer_prompt_tokens", "Prompt tokens of finished requests "
                                     "(image tokens included)", registry=r)
        self.generation_tokens = Counter("edgeinfer_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.finished = Counter("edgeinfer_request_finish", "Finished generations by finish reason",
                                ["reason"], registry=r)
        self.preflight_rejections = Counter("edgeinfer_preflight_rejections",
                                            "Requests refused by image preflight, by reason", ["reason"],
                                            registry=r)
        ProcessCollector(namespace="edgeinfer", registry=r)
        r.register(_LiveCollector(engine, model, _kv_collector(engine), decoder))
        r.register(_SleepCollector(engine, throttle))

    def observe(self, completion: Completion) -> None:
        stats, result = completion.stats, completion.result
        self.e2e.observe(stats.total_s)
        self.queue_time.observe(stats.queued_s)
        if stats.ttft_s is not None:
            self.ttft.observe(stats.ttft_s)
        if stats.tpot_s is not None:
            self.tpot.observe(stats.tpot_s)
        self.prompt_tokens.inc(result.usage.get("prompt_tokens", 0))
        self.generation_tokens.inc(result.usage.get("completion_tokens", 0))
        self.finished.labels(result.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """Gauges computed at scrape time."""

    def __init__(self, engine: Callable[[], AsyncEngine | None], model: str,
                 kv: CollectorRegistry | None, decoder: Callable[[], DecodeBudget | None]) -> None:
        self._engine = engine
        self._decoder = decoder
        self._model = model
        self._kv = kv
        self._power: list[tuple[str, dict[str, str], float]] = []
        self._power_at = 0.0
        self._power_lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # names vary with the board; nothing to check ahead of time

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        ready = GaugeMetricFamily("edgeinfer_model_ready", "1 when the model is loaded and taking requests",
                                  labels=["model"])
        ready.add_metric([self._model], float(engine is not None and engine.accepting))
        yield ready
        yield from _memory()
        if engine is not None:
            yield from _engine_metrics(engine, self._kv)
        decoder = self._decoder()
        if decoder is not None:
            yield from _decode_metrics(decoder)
        yield from _families(self._power_gauges(), "board reading")

    def _power_gauges(self) -> list[tuple[str, dict[str, str], float]]:
        # jtop and sysfs reads are not free: sample at most every POWER_EVERY_S.
        with self._power_lock:
            if time.monotonic() - self._power_at > POWER_EVERY_S:
                from edgeinfer.power import read_power_snapshot

                try:
                    self._power = read_power_snapshot().gauges()
                except Exception:  # a board file that changed under us: no readings this time
                    self._power = []
                self._power_at = time.monotonic()
            return self._power


class _SleepCollector(Collector):
    """Sleep state and counts (the engine's own), and power- and heat-aware admission."""

    def __init__(self, engine: Callable[[], AsyncEngine | None], throttle: Callable[[], Any]) -> None:
        self._engine = engine
        self._throttle = throttle

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        stats = getattr(engine.engine, "sleep_stats", None) if engine is not None else None
        if stats is not None:
            yield _gauge("edgeinfer_sleep_level", "0 awake, 1 asleep with weights in host memory, "
                         "2 asleep with weights dropped", stats.level)
            sleeps = CounterMetricFamily("edgeinfer_sleeps", "Times the engine went to sleep", labels=["level"])
            for level, count in sorted(stats.sleeps.items()):
                sleeps.add_metric([str(level)], count)
            yield sleeps
            wakes = CounterMetricFamily("edgeinfer_wakes", "Times the engine woke up")
            wakes.add_metric([], stats.wakes)
            yield wakes
            wake_s = CounterMetricFamily("edgeinfer_wake_seconds", "Seconds spent waking up, in all")
            wake_s.add_metric([], stats.wake_s_total)
            yield wake_s
            yield _gauge("edgeinfer_last_wake_seconds", "Seconds the last wake took", stats.last_wake_s)
        state = self._throttle()
        if state is not None:
            yield _gauge("edgeinfer_throttled", "1 while the board is at its power or heat limit", state.throttled)
        if engine is not None:
            yield _gauge("edgeinfer_admission_max_concurrent", "Requests admitted into the engine at once now",
                         engine.max_concurrent)
            yield _gauge("edgeinfer_admission_max_queue", "Requests that may wait now", engine.max_queue)


def _gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _memory() -> Iterator[Metric]:
    memory = psutil.virtual_memory()
    yield _gauge("edgeinfer_memory_available_bytes", "MemAvailable of the machine", memory.available)
    yield _gauge("edgeinfer_memory_total_bytes", "Memory of the machine", memory.total)
    try:
        import torch

        if torch.cuda.is_available():
            yield _gauge("edgeinfer_cuda_memory_allocated_bytes", "Memory torch holds on the GPU",
                         torch.cuda.memory_allocated())
    except Exception:  # no usable torch.cuda: no GPU gauge
        return


def _decode_metrics(decoder: DecodeBudget) -> Iterator[Metric]:
    usage = decoder.usage()
    decode_bytes = GaugeMetricFamily("edgeinfer_image_decode_bytes", "Image decode budget: its capacity, the "
                                     "bytes reserved now, the most ever reserved at once", labels=["state"])
    for state, value in (("capacity", usage.capacity_bytes), ("reserved", usage.reserved_bytes),
                         ("peak", usage.peak_bytes)):
        decode_bytes.add_metric([state], value)
    yield decode_bytes
    yield _gauge("edgeinfer_image_decodes_running", "Image decodes holding a reservation", usage.running)
    yield _gauge("edgeinfer_image_decodes_waiting", "Image decodes waiting for the budget", usage.waiting)


def _kv_collector(engine: Callable[[], AsyncEngine | None]) -> CollectorRegistry | None:
    """The KV package's own collector (typed counters and histograms) over the engine
    thread's snapshot, in a registry of its own so that it is only read once there is one."""
    try:
        from edgeinfer.kv.metrics import register_kv_metrics
    except ImportError:
        return None
    kv = CollectorRegistry(auto_describe=False)
    register_kv_metrics(kv, lambda: engine().snapshot.kv)  # type: ignore[union-attr]
    return kv


def _engine_metrics(engine: AsyncEngine, kv: CollectorRegistry | None) -> Iterator[Metric]:
    snap = engine.snapshot
    yield _gauge("edgeinfer_queue_depth", "Requests waiting for an engine slot", engine.queue_depth)
    yield _gauge("edgeinfer_requests_running", "Requests inside the engine", engine.running)
    yield _gauge("edgeinfer_queue_capacity", "max_concurrent + max_queue", engine.capacity)
    if snap.kv is None:  # an engine without a KV manager: the pool's own counts
        blocks = GaugeMetricFamily("edgeinfer_kv_blocks", "KV blocks by tier and state", labels=["tier", "state"])
        blocks.add_metric(["device", "free"], snap.kv_free)
        blocks.add_metric(["device", "used"], snap.kv_total - snap.kv_free)
        yield blocks
        usage = (snap.kv_total - snap.kv_free) / snap.kv_total if snap.kv_total else 0.0
        yield _gauge("edgeinfer_kv_usage_ratio", "Used share of the KV blocks", usage, tier="device")
    elif kv is not None and hasattr(snap.kv, "tiers"):
        yield from kv.collect()
    else:
        yield from _families(list(metric_triples(snap.kv)), "KV cache")
    for name, value in sorted(snap.counters.items()):
        counter = CounterMetricFamily(f"edgeinfer_engine_{name}", f"Engine counter {name}")
        counter.add_metric([], value)
        yield counter


def _families(triples: list[tuple[str, dict[str, str], float]], doc: str) -> Iterator[Metric]:
    """(name, labels, value) triples as gauge families, one per name."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for name, labels, value in triples:
        by_name[name].append((labels, value))
    for name, samples in by_name.items():
        keys = sorted({key for labels, _ in samples for key in labels})
        family = GaugeMetricFamily(name, doc, labels=keys)
        for labels, value in samples:
            family.add_metric([labels.get(key, "") for key in keys], value)
        yield family
