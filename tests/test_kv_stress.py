"""Random workloads on a squeezed pool: tokens equal an unconstrained run, and the books balance after."""

from __future__ import annotations

import random

import pytest

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.engine.sequence import Status
from tests.conftest import noise_image

IMAGES = [noise_image(96, 64, seed=s) for s in range(3)]
WORDS = "what is in the image how many red circles describe color left right top".split()


def workload(seed: int) -> list[tuple[str, list, SamplingParams]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(7):
        images = rng.sample(IMAGES, rng.choice([0, 1, 1, 2]))
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        tokens = rng.randint(4, 20)
        requests.append((question, images, SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens)))
    return requests


def play(engine, requests, seed: int) -> list[list[int]]:
    """Submit in random bursts, cancel one request midway, step until done."""
    rng = random.Random(seed)
    pending, seqs, cancelled = list(requests), [], None
    while pending or engine.has_work():
        if pending and rng.random() < 0.6:
            seqs.append(engine.submit(*pending.pop(0)))
        if cancelled is None and len(seqs) == 4 and seqs[3].status is Status.RUNNING:
            cancelled = seqs[3]
            engine.cancel(cancelled)
        engine.step()
    return [engine.result(s).token_ids if s is not cancelled else None for s in seqs]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_keep_tokens_and_books(checkpoint, tmp_path, seed):
    path = checkpoint("smolvlm")
    requests = workload(seed)
    free = Engine.load(path, config=EngineConfig(num_blocks=512, max_batch_size=4))
    want = play(free, requests, seed)
    squeezed = Engine.load(path, config=EngineConfig(
        block_size=4, num_blocks=26, max_batch_size=4, host_tier_mb=1, disk_tier_mb=1, disk_dir=str(tmp_path),
        high_watermark=0.5, low_watermark=0.3, kv_policy=["lru-k", "lru"][seed % 2]))
    got = play(squeezed, requests, seed)
    assert [g for g, w in zip(got, want) if w is not None] == [w for w in want if w is not None]
    manager = squeezed.kv_manager
    assert manager.stats.restored_blocks > 0
    manager.worker.drain()
    manager.poll()
    manager.check()
    pool = squeezed.pool
    assert pool.num_free == pool.num_blocks and all(pool.refcount(b) == 0 for b in range(pool.num_blocks))
    squeezed.close()
