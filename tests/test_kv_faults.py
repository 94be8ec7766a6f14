"""Faults of the disk tier: corrupted blocks, a full disk, a process killed mid-store, another model's cache.

Each fault is made at the outermost boundary (bytes in the file, ``os.pwrite``/``os.write``,
SIGKILL), and the engine must answer with the tokens of a cold run.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.testing.checkpoints import make_checkpoint
from tests.conftest import noise_image

FORCED = SamplingParams(max_new_tokens=16, min_new_tokens=16)
IMAGE = noise_image(128, 96, seed=1)
QUESTION = "what is in the image ?"


def engine_on(path, disk_dir, **config):
    config.setdefault("num_blocks", 64)
    return Engine.load(path, config=EngineConfig(disk_tier_mb=4, disk_dir=str(disk_dir), **config))


@pytest.fixture(scope="module")
def cold(checkpoint):
    return Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=64)).generate(QUESTION, [IMAGE], FORCED)


def test_a_restarted_engine_reuses_the_disk_cache(checkpoint, cold, tmp_path):
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE], FORCED)
    first.close()
    again = engine_on(checkpoint("smolvlm"), tmp_path)
    result = again.generate(QUESTION, [IMAGE], FORCED)
    assert result.cache["restored_blocks"] > 0 and result.cache["vision_reused"] == 1
    assert again.counters["vision_runs"] == 0 and result.token_ids == cold.token_ids
    again.close()


def test_a_corrupted_disk_block_is_recomputed(checkpoint, cold, tmp_path, caplog):
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE], FORCED)
    first.close()
    data = first.kv_manager.disk.dir / "blocks.dat"
    slot = first.kv_manager.codec.nbytes
    raw = bytearray(data.read_bytes())
    for offset in range(100, len(raw), slot):  # one flipped byte in every block
        raw[offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    again = engine_on(checkpoint("smolvlm"), tmp_path)
    with caplog.at_level(logging.WARNING):
        result = again.generate(QUESTION, [IMAGE], FORCED)
    assert result.token_ids == cold.token_ids
    assert again.counters["recomputes"] >= 1 and "checksum" in caplog.text
    again.close()
    third = engine_on(checkpoint("smolvlm"), tmp_path)  # the bad blocks were replaced by good ones
    assert third.generate(QUESTION, [IMAGE], FORCED).token_ids == cold.token_ids
    assert third.counters["recomputes"] == 0 and third.counters["restored_blocks"] > 0
    third.close()


def test_the_cache_report_after_a_corrupted_block_counts_only_what_was_reused(checkpoint, cold, tmp_path):
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE], FORCED)
    first.close()
    data = first.kv_manager.disk.dir / "blocks.dat"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # the first block: every block after it hangs off its key, so all are recomputed
    data.write_bytes(bytes(raw))
    again = engine_on(checkpoint("smolvlm"), tmp_path)
    result = again.generate(QUESTION, [IMAGE], FORCED)
    assert result.token_ids == cold.token_ids
    assert result.cache["prefix_tokens_reused"] == 0 and result.cache["restored_blocks"] == 0
    assert result.cache["recomputed_blocks"] > 0
    counters = again.counters
    assert counters["prefix_tokens_reused"] == 0 and counters["restored_blocks"] == 0
    assert counters["recomputes"] == 1 and counters["prefix_hits"] == 0
    assert result.usage["prompt_tokens"] == again.counters["prefill_tokens"]  # all of it computed
    again.close()


def test_a_full_disk_degrades_to_recompute_with_one_warning(checkpoint, tmp_path, monkeypatch, caplog):
    questions = [(QUESTION, [IMAGE]), ("describe this picture", []),
                 ("how many red circle are there ?", [noise_image(64, 64, seed=5)])]
    squeezed = dict(block_size=4, num_blocks=26, max_batch_size=3)
    reference = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=256, max_batch_size=3))
    want = [r.token_ids for r in reference.run_until_done([reference.submit(q, i, FORCED) for q, i in questions])]

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    # Engines earlier tests left open write through when they are collected: not while the disk is "full".
    gc.collect()
    monkeypatch.setattr("edgeinfer.kv.disk.os.pwrite", no_space)
    engine = engine_on(checkpoint("smolvlm"), tmp_path, **squeezed)
    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv"):
        got = [r.token_ids for r in engine.run_until_done([engine.submit(q, i, FORCED) for q, i in questions])]
        engine.kv_manager.flush()  # the write-through still in flight fails here, not after the check
    assert got == want
    assert engine.counters["preemptions"] > 0 and engine.kv_metrics().disk_errors > 0
    folder = str(engine.kv_manager.disk.dir)
    ours = [r.getMessage() for r in caplog.records if folder in r.getMessage()]
    assert len(ours) == 1 and "disk is full" in ours[0]  # one warning, however many stores failed
    engine.close()


CHILD = textwrap.dedent("""
    import os, signal, sys
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams
    from tests.conftest import noise_image

    path, disk_dir = sys.argv[1], sys.argv[2]
    engine = Engine.load(path, config=EngineConfig(num_blocks=64, disk_tier_mb=4, disk_dir=disk_dir))
    params = SamplingParams(max_new_tokens=16, min_new_tokens=16)
    engine.generate("what is in the image ?", [noise_image(128, 96, seed=1)], params)
    engine.kv_manager.worker.drain()
    real_write, journal = os.write, engine.kv_manager.disk._journal
    stored = []

    def dying_write(fd, data):
        if fd == journal and data.startswith(b"P"):
            stored.append(data)
            if len(stored) == 2:  # the second block of the next store: half a line, then death
                real_write(fd, data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        return real_write(fd, data)

    os.write = dying_write
    engine.generate("describe this picture", [noise_image(64, 64, seed=5)], params)
    engine.kv_manager.worker.drain()
    print("not killed")
""")


def test_a_process_killed_during_a_store_leaves_a_repairable_index(checkpoint, cold, tmp_path):
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint("smolvlm")), str(tmp_path)], cwd=root,
                           capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, "PYTHONPATH": str(root)})
    assert child.returncode == -9, child.stderr[-2000:]
    again = engine_on(checkpoint("smolvlm"), tmp_path)
    assert again.kv_metrics().disk_repaired == 1  # the torn line
    result = again.generate(QUESTION, [IMAGE], FORCED)
    assert result.token_ids == cold.token_ids and result.cache["restored_blocks"] > 0
    other = again.generate("describe this picture", [noise_image(64, 64, seed=5)], FORCED)
    fresh = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=64))
    assert other.token_ids == fresh.generate("describe this picture", [noise_image(64, 64, seed=5)], FORCED).token_ids
    assert again.counters["recomputes"] == 0
    again.close()


def test_another_models_cache_is_never_used(checkpoint, tmp_path_factory, tmp_path):
    twin = make_checkpoint("smolvlm", tmp_path_factory.mktemp("twin"), seed=1)  # same config, other weights
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE], FORCED)
    first.close()
    other = engine_on(twin, tmp_path)
    result = other.generate(QUESTION, [IMAGE], FORCED)
    assert result.cache["prefix_tokens_reused"] == 0 and result.cache["restored_blocks"] == 0
    assert other.counters["vision_runs"] == 1  # nor its vision outputs
    assert other.kv_manager.disk.dir != first.kv_manager.disk.dir
    cold_twin = Engine.load(twin, config=EngineConfig(num_blocks=64)).generate(QUESTION, [IMAGE], FORCED)
    assert result.token_ids == cold_twin.token_ids
    other.close()
