"""The KV manager inside the engine: spilling keeps tokens, the prefix cache skips work, triggers, wiring.

Real tiny checkpoints, real pools of a few blocks, real host and disk tiers under tmp_path.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import pytest

from edgeinfer.bench.kv import max_logit_drift, record_logits
from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.errors import ProfileError
from edgeinfer.profiles import load_profile
from tests.conftest import noise_image

FORCED = SamplingParams(max_new_tokens=24, min_new_tokens=24)
IMAGE = noise_image(128, 96, seed=1)
QUESTIONS = [
    ("what is in the image ?", [IMAGE]),
    ("describe this picture", []),
    ("how many red circle are there in the top left of the image ?", [noise_image(64, 64, seed=5)]),
    ("color", [noise_image(80, 128, seed=7), noise_image(64, 96, seed=8)]),
]
# 4-token blocks; 30 blocks hold about one and a half of the four sequences: preemption all the time,
# and idle blocks above 40% of the pool spill at every step.
SQUEEZED = dict(block_size=4, num_blocks=30, max_batch_size=4, high_watermark=0.4, low_watermark=0.2)


def run(path, questions=QUESTIONS, logits=None, **config):
    engine = Engine.load(path, config=EngineConfig(**config))
    if logits is not None:
        record_logits(engine, logits)
    seqs = [engine.submit(q, im, FORCED) for q, im in questions]
    results = engine.run_until_done(seqs)
    counters = engine.counters
    engine.close()
    return [r.token_ids for r in results], counters, results


@pytest.fixture(scope="module")
def reference(checkpoint):
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            logits: dict = {}
            tokens, _, _ = run(checkpoint(family), logits=logits, num_blocks=256, max_batch_size=4)
            cache[family] = tokens, logits
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl", "llava"])
def test_full_precision_tiers_under_constant_spilling_keep_greedy_tokens(checkpoint, reference, tmp_path, family):
    tokens, counters, results = run(checkpoint(family), host_tier_mb=1, disk_tier_mb=4, disk_dir=str(tmp_path),
                                    **SQUEEZED)
    assert tokens == reference(family)[0]
    assert counters["preemptions"] >= 2 and counters["spilled_blocks"] >= 10 and counters["restored_blocks"] >= 10
    assert sum(r.cache["restored_blocks"] for r in results) == counters["restored_blocks"]


def test_disk_only_tier_restores_the_same_tokens(checkpoint, reference, tmp_path):
    tokens, counters, _ = run(checkpoint("smolvlm"), disk_tier_mb=4, disk_dir=str(tmp_path), **SQUEEZED)
    assert tokens == reference("smolvlm")[0]
    assert counters["restored_blocks"] > 0 and counters["recomputes"] == 0


def test_preempted_sequences_are_restored_not_recomputed(checkpoint):
    prompts = sum(len(Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=64)).submit(q, im).prompt_ids)
                  for q, im in QUESTIONS)
    _, spilled, _ = run(checkpoint("smolvlm"), host_tier_mb=1, **SQUEEZED)
    _, dropped, _ = run(checkpoint("smolvlm"), **SQUEEZED)  # no lower tier: preemption recomputes
    assert spilled["preemptions"] > 0 and dropped["preemptions"] > 0
    assert spilled["prefill_tokens"] <= prompts < dropped["prefill_tokens"]


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_compressed_host_tier_drifts_little(checkpoint, reference, precision):
    logits: dict = {}
    tokens, counters, _ = run(checkpoint("smolvlm"), logits=logits, host_tier_mb=1, host_precision=precision,
                              **SQUEEZED)
    ref_tokens, ref_logits = reference("smolvlm")
    drift = max_logit_drift(ref_logits, logits, ref_tokens, tokens)
    print(f"{precision}: max logit drift {drift.max_abs:.4f} over {drift.compared} steps, "
          f"{drift.same_tokens}/{drift.total_tokens} tokens equal")
    assert counters["restored_blocks"] > 0 and drift.compared > 50
    assert drift.max_abs < (0.5 if precision == "int8" else 2.0)


def test_a_second_question_about_the_same_image_skips_vision_and_image_prefill(checkpoint):
    path = checkpoint("smolvlm")
    cold = Engine.load(path, config=EngineConfig(num_blocks=64)).generate("how many shapes ?", [IMAGE], FORCED)
    engine = Engine.load(path, config=EngineConfig(num_blocks=64))
    engine.generate("what is in the image ?", [IMAGE], FORCED)
    before = engine.counters
    second = engine.generate("how many shapes ?", [IMAGE], FORCED)
    delta = {k: engine.counters[k] - before[k] for k in before}
    image_end = max(s.end for s in engine.submit("x", [IMAGE]).image_spans)
    assert delta["vision_runs"] == 0 and delta["vision_reused"] == 1 and second.cache["vision_reused"] == 1
    assert second.cache["prefix_tokens_reused"] >= image_end  # every image token came from the cache
    assert delta["prefill_tokens"] == second.usage["prompt_tokens"] - second.cache["prefix_tokens_reused"]
    assert second.token_ids == cold.token_ids


def test_a_different_image_behind_the_same_tokens_never_matches(checkpoint):
    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=64, block_size=4))
    engine.generate("what is in the image ?", [IMAGE], FORCED)
    other = engine.generate("what is in the image ?", [noise_image(128, 96, seed=2)], FORCED)
    first_image_token = min(s.start for s in engine.submit("x", [IMAGE]).image_spans)
    assert other.cache["prefix_tokens_reused"] <= first_image_token  # only the text before the image
    assert other.cache["vision_reused"] == 0


def test_a_follow_up_turn_reuses_the_conversation(checkpoint):
    engine = Engine.load(checkpoint("qwen2_vl"), config=EngineConfig(num_blocks=64))
    first = engine.generate("what is in the image ?", [IMAGE], FORCED)
    history = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image ?"}]},
               {"role": "assistant", "content": first.text},
               {"role": "user", "content": "and the color ?"}]
    follow_up = engine.generate(history, [IMAGE], FORCED)
    cold = Engine.load(checkpoint("qwen2_vl"), config=EngineConfig(num_blocks=64)).generate(history, [IMAGE], FORCED)
    assert follow_up.cache["prefix_tokens_reused"] >= first.usage["prompt_tokens"]
    assert follow_up.token_ids == cold.token_ids


def test_idle_sessions_spill_before_running_ones(checkpoint):
    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(
        block_size=4, num_blocks=40, host_tier_mb=1, high_watermark=0.5, low_watermark=0.25))
    idle = engine.generate(*QUESTIONS[0], FORCED)  # finished: its blocks are an idle session
    running = engine.submit(*QUESTIONS[2], FORCED)
    engine.run_until_done([running])
    metrics = engine.kv_metrics()
    assert engine.counters["preemptions"] == 0 and metrics.spilled_blocks > 0
    assert metrics.tiers["host"].blocks["idle"] >= metrics.spilled_blocks - 1
    again = engine.generate(*QUESTIONS[0], FORCED)  # the idle session comes back from the host
    assert again.cache["restored_blocks"] > 0 and again.token_ids == idle.token_ids
    engine.close()


def test_available_memory_under_the_floor_empties_the_host_tier(checkpoint, monkeypatch, caplog):
    import psutil

    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(
        block_size=4, num_blocks=40, host_tier_mb=1, high_watermark=0.3, low_watermark=0.1,
        available_floor_mb=512))
    engine.generate(*QUESTIONS[0], FORCED)
    engine.generate(*QUESTIONS[2], FORCED)
    engine.kv_manager.flush()
    assert engine.kv_metrics().tiers["host"].used_blocks > 0
    available = psutil.virtual_memory()._replace(available=100 * 2**20)  # the machine runs short
    monkeypatch.setattr(psutil, "virtual_memory", lambda: available)
    start, seconds = time.monotonic(), itertools.count(1)  # a clock a second on at every poll: read each time
    monkeypatch.setattr(engine.kv_manager, "clock", lambda: start + next(seconds))
    with caplog.at_level(logging.WARNING):
        for _ in range(40):
            engine.kv_manager.poll()
            engine.kv_manager.flush()
    assert engine.kv_metrics().tiers["host"].used_blocks == 0
    assert engine.kv_metrics().floor_events == 1 and "floor" in caplog.text
    engine.close()


def test_profile_fields_reach_the_kv_manager(checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    profile = load_profile("orin-nano-8gb", ["kv.device_blocks=4", "kv.policy=lru", "memory.disk_tier_mb=8"])
    config = EngineConfig.from_profile(profile)
    assert (config.num_blocks, config.host_precision, config.kv_policy) == (4, "int8", "lru")
    assert config.disk_dir == str(tmp_path / "edgeinfer" / "kv") and config.unified_memory
    manager_config = config.kv_manager_config()
    assert (manager_config.high_watermark, manager_config.low_watermark) == (0.85, 0.70)
    assert not manager_config.pin_host  # unified memory: pinning buys nothing
    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=8, kv_policy="lru"))
    assert engine.pool.num_blocks == 8
    with pytest.raises(ProfileError, match="lru-k"):
        Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=8, kv_policy="clock"))


DEMO = Path(__file__).resolve().parents[1] / "edgeinfer" / "demo_model"


def test_demo_model_under_constant_spilling(tmp_path):
    """Twelve questions asked twice: the squeezed pool (about two prompts) pushes the first
    round's prompts out to the tiers, and the second round restores them."""
    from edgeinfer.demo import synthetic

    samples = synthetic.held_out(7, 12)
    params = SamplingParams(max_new_tokens=6)

    def answers(**config):
        engine = Engine.load(DEMO, config=EngineConfig(**config))
        rounds = [engine.run_until_done([engine.submit(s.question, [s.image], params) for s in samples])
                  for _ in range(2)]
        counters = engine.counters
        engine.close()
        return [r.token_ids for r in rounds[0] + rounds[1]], [r.text for r in rounds[1]], counters

    squeeze = {"block_size": 4, "num_blocks": 48, "max_batch_size": 12, "high_watermark": 0.4, "low_watermark": 0.2}
    free_tokens, free_text, _ = answers(num_blocks=1024, max_batch_size=12)
    tokens, _, counters = answers(**squeeze, host_tier_mb=8, disk_tier_mb=8, disk_dir=str(tmp_path))
    assert tokens == free_tokens and counters["restored_blocks"] > 0
    _, int8_text, int8_counters = answers(**squeeze, host_tier_mb=8, host_precision="int8")
    assert int8_counters["restored_blocks"] > 0
    right = [t.strip(" .").lower() == s.answer for t, s in zip(int8_text, samples)]
    free_right = [t.strip(" .").lower() == s.answer for t, s in zip(free_text, samples)]
    assert sum(right) >= sum(free_right) - 1  # int8 costs at most one answer in twelve
