"""The serving benchmark's arithmetic, and one tiny run of it through the real AsyncEngine on
the demo model (structure and counts only: no figure is asserted)."""

from __future__ import annotations

import gc
import statistics
from types import SimpleNamespace

import pytest

from edgeinfer.bench.serve import ServeBenchSpec, arrivals, bench, camera_overrides, counting, markdown, percentile
from edgeinfer.demo import DEMO_MODEL_DIR


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == statistics.median(values)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([], 50) is None


def test_arrivals_are_poisson_at_the_rate_and_fixed_by_the_seed():
    times = arrivals(4.0, 4000, seed=3)
    assert times == arrivals(4.0, 4000, seed=3) and times != arrivals(4.0, 4000, seed=4)
    assert all(b > a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)  # mean gap 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: sd equals the mean


def test_the_pictures_size_is_the_cameras_size_unless_overridden():
    from edgeinfer.profiles import load_profile

    spec = ServeBenchSpec(DEMO_MODEL_DIR, overrides=("server.max_queue=3",), image_size=(640, 480))
    assert load_profile("cuda", camera_overrides(spec)).runtime.vision_compile_sizes == ("640x480",)
    own = ServeBenchSpec(DEMO_MODEL_DIR, overrides=("runtime.vision_compile_sizes=[]",), image_size=(640, 480))
    assert load_profile("cuda", camera_overrides(own)).runtime.vision_compile_sizes == ()


def test_a_tiny_run_answers_every_request_and_records_refusals():
    spec = ServeBenchSpec(DEMO_MODEL_DIR, profile="cpu",
                          overrides=("server.max_concurrent=1", "server.max_queue=1"),  # room for 2 of 3
                          image_size=(64, 64), new_tokens=3, burst=3, first_seen=2, rates=(50.0,), requests=2,
                          sampled_share=0.5)
    gc.unfreeze()
    report = bench(spec, say=lambda _: None)
    assert gc.get_freeze_count() > 0, "as in the daemon, start-up's objects are out of the collector's sight"
    burst = report["burst"]["summary"]
    assert burst["requests"] == 3 and burst["refused"] == 1 and burst["answered"] == 2 and burst["failed"] == 0
    assert all(r["tokens"] == 3 for r in report["burst"]["records"] if "tokens" in r)
    assert report["first_seen"]["first"]["answered"] == 2 and report["first_seen"]["ratio"] > 0
    assert report["limits"] == {"max_concurrent": 1, "max_queue": 1}
    assert [run["label"] for run in report["runs"]] == ["first seen", "burst", "open loop 50/s"]
    assert all(len(run["load"]["before"]) == 3 for run in report["runs"])  # the load average beside each part
    assert report["open_loop"][0]["summary"]["requests"] == 2
    assert "| 50 |" in markdown(report)
    # The CPU profile compiles and captures nothing on live traffic.
    assert report["burst"]["summary"]["during"] == {"compiled_graphs": 0, "decoder_captures": 0, "tower_graphs": 0,
                                                   "packed_tiles_chosen": 0, "fused_row_tiles": 0}


def test_a_part_counts_what_was_compiled_during_it():
    import torch

    engine = SimpleNamespace(decoder_engine=None, vision_engine=SimpleNamespace(captured_signatures={("a",)}))
    counted = {}
    with counting(engine, counted):
        torch.compile(lambda x: x * 3 + 1, backend="eager", fullgraph=True)(torch.ones(2))
        engine.vision_engine.captured_signatures = {("a",), ("b",)}
    assert counted["during"] == {"compiled_graphs": 1, "decoder_captures": 0, "tower_graphs": 1,
                                 "packed_tiles_chosen": 0, "fused_row_tiles": 0}


def test_spec_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="sampled_share"):
        ServeBenchSpec(DEMO_MODEL_DIR, sampled_share=1.5)
    with pytest.raises(ValueError, match="rates"):
        ServeBenchSpec(DEMO_MODEL_DIR, rates=(0.0,))
