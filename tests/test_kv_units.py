"""The KV package's parts at tiny size: keys, policies, codecs, pool, host and disk tiers, worker, metrics."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch

from edgeinfer.errors import ProfileError
from edgeinfer.kv.codec import BlockGeometry, fp8_supported, make_codec
from edgeinfer.kv.disk import ChecksumError, DiskBusyError, DiskLayout, DiskStore, default_cache_dir
from edgeinfer.kv.embeddings import EmbeddingStore
from edgeinfer.kv.hashing import ImageSpan, chain, full_key, image_spans, partial_key
from edgeinfer.kv.host import HostStore
from edgeinfer.kv.metrics import Histogram, register_kv_metrics
from edgeinfer.kv.policy import POLICIES, LRUKPolicy, LRUPolicy, Priority, make_policy
from edgeinfer.kv.pool import BlockPool, KVCache
from edgeinfer.kv.pressure import MemoryFloor, Watermarks
from edgeinfer.kv.worker import Job, SpillWorker

ROOT = b"\1" * 16
IMG = 7


# --- keys -----------------------------------------------------------------------------------
def test_image_spans_follow_split_placeholders():
    ids = [1, IMG, IMG, 5, IMG, 2, IMG, IMG, IMG, 3]
    spans = image_spans(ids, IMG, [("a", 3), ("b", 3)])
    assert spans == (ImageSpan(1, 3, "a", 0), ImageSpan(4, 5, "a", 2), ImageSpan(6, 9, "b", 0))


def test_same_tokens_different_images_never_share_a_key():
    ids = [1, IMG, IMG, IMG, IMG, 2, 3, 4]
    a = chain(ROOT, ids, image_spans(ids, IMG, [("img-a", 4)]), 4)
    b = chain(ROOT, ids, image_spans(ids, IMG, [("img-b", 4)]), 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the second block differs through the chain
    assert chain(ROOT, ids, image_spans(ids, IMG, [("img-a", 4)]), 4) == a


def test_keys_depend_on_the_model_and_on_position():
    ids = [5, 6, 7, 8]
    assert full_key(ROOT, ids, (), 0) != full_key(b"\2" * 16, ids, (), 0)
    assert full_key(ROOT, ids, (), 0) != partial_key(ROOT, ids, (), 0)
    assert chain(ROOT, ids * 2, (), 4)[1] != chain(ROOT, ids, (), 4)[0]


# --- policies --------------------------------------------------------------------------------
def test_lru_k_evicts_once_read_blocks_before_twice_read_ones():
    policy = LRUKPolicy(k=2, window=100)
    for step, key in enumerate("abc"):
        policy.insert(key, step)
    policy.touch("a", 5)  # a: two accesses
    assert policy.evict(1, 6) == ["b"]  # b and c have one; b's is older
    assert policy.evict(1, 6) == ["c"]
    assert policy.evict(1, 6) == ["a"]


def test_lru_k_window_forgets_old_accesses_and_keeps_history_of_withdrawn_keys():
    policy = LRUKPolicy(k=2, window=10)
    policy.insert("old", 0)
    policy.touch("old", 1)
    policy.insert("new", 50)
    policy.touch("new", 51)
    policy.insert("once", 52)
    # "old" was read twice, but both reads fell out of the window: it ranks with "once", older.
    assert policy.evict(1, 55) == ["old"]
    policy.remove("new")
    policy.insert("new", 56)  # back within the window: it remembers the read at 51
    assert policy.evict(1, 57) == ["once"]


def test_priorities_go_before_recency():
    for policy in (LRUKPolicy(), LRUPolicy()):
        policy.insert("preempted", 0, Priority.PREEMPTED)
        policy.insert("idle", 9, Priority.IDLE)
        policy.touch("idle", 10)
        assert policy.evict(1, 11) == ["idle"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_evict_is_atomic(name):
    policy = make_policy(name)
    policy.insert("a", 0)
    policy.insert("b", 1)
    assert policy.evict(3, 2) == []
    assert len(policy) == 2 and "a" in policy and "b" in policy
    assert sorted(policy.evict(2, 2)) == ["a", "b"]
    assert len(policy) == 0


def test_unknown_policy_lists_the_valid_names():
    with pytest.raises(ProfileError) as info:
        make_policy("mru")
    assert "lru-k" in str(info.value) and "lru" in str(info.value) and info.value.field == "kv.policy"


# --- pressure rules ------------------------------------------------------------------------------
def test_device_watermarks_spill_down_to_low_once_above_high():
    marks = Watermarks(high=0.5, low=0.25)
    assert marks.device_excess(used=20, capacity=40) == 0  # at the high watermark: nothing
    assert marks.device_excess(used=21, capacity=40) == 21 - 10
    with pytest.raises(ValueError, match="low"):
        Watermarks(high=0.5, low=0.5)


def test_host_tier_shrinks_above_high_only_with_a_disk_and_always_under_the_floor():
    marks = Watermarks(high=0.9, low=0.5)
    assert marks.host_excess(95, 100, floor_breached=False, has_disk=True) == 45
    assert marks.host_excess(95, 100, floor_breached=False, has_disk=False) == 0  # nowhere to go
    assert marks.host_excess(40, 100, floor_breached=True, has_disk=False) == 20  # half of what is there
    assert marks.host_excess(0, 100, floor_breached=True, has_disk=True) == 0


def test_memory_floor_is_read_on_its_interval_and_reports_the_crossing_once():
    floor = MemoryFloor(floor_mb=512, check_s=0.25)
    assert floor.due(0.0) and not floor.observe(600 * 2**20, 0.0)
    assert not floor.due(0.2) and floor.due(0.25)
    assert floor.observe(100 * 2**20, 0.25) and floor.breached  # just went under: warn now
    assert not floor.observe(100 * 2**20, 0.5) and floor.breached  # still under: no second warning
    assert not floor.observe(600 * 2**20, 0.75) and not floor.breached
    assert not MemoryFloor(0, 0.25).due(10.0)  # a floor of 0 is off


# --- codecs ----------------------------------------------------------------------------------
GEOMETRY = BlockGeometry(layers=2, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)


def _blocks(n=3, geometry=GEOMETRY, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn((n, *geometry.block_shape), generator=gen) * torch.tensor([1.0, 30.0])[None, None, None, :, None]
    return k.to(geometry.dtype), (k * 0.5 + 1).to(geometry.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_codec_is_bit_exact(dtype):
    geometry = BlockGeometry(2, 4, 2, 8, dtype)
    codec = make_codec("full", geometry)
    k, v = _blocks(geometry=geometry)
    payload = codec.encode(k, v)
    assert payload.dtype == torch.uint8 and payload.shape == (3, codec.nbytes)
    k2, v2 = codec.decode(payload.clone())
    assert torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("name,bound", [("int8", 1 / 127), ("fp8", 1 / 16)])
def test_scaled_codecs_keep_per_head_relative_error(name, bound):
    if name == "fp8" and not fp8_supported():
        pytest.skip("no float8_e4m3fn in this torch")
    codec = make_codec(name, GEOMETRY)
    k, v = _blocks()
    payload = codec.encode(k, v)
    assert codec.nbytes < make_codec("full", GEOMETRY).nbytes / 3
    k2, v2 = codec.decode(payload)
    for x, y in ((k, k2), (v, v2)):
        amax = x.abs().amax(dim=(2, 4), keepdim=True)  # per block, layer, head
        assert ((x - y).abs() <= amax * bound + 1e-6).all()  # a head 30x larger does not swamp the small one


def test_unknown_host_precision_is_a_profile_error():
    with pytest.raises(ProfileError):
        make_codec("int4", GEOMETRY)


# --- pool -------------------------------------------------------------------------------------
def test_cached_blocks_stay_idle_until_revived_or_uncached():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.mark_cached(a)
    pool.free([a, b])
    assert pool.num_free == 4 and pool.num_blank == 3 and pool.is_idle(a) and pool.refcount(a) == 0
    assert not pool.can_allocate(4)  # the idle block is the policy's to give up
    pool.revive(a)
    assert pool.refcount(a) == 1 and not pool.is_idle(a)
    pool.free([a])
    pool.uncache(a)
    assert pool.num_blank == 4
    with pytest.raises(ValueError):
        pool.revive(a)


def test_kv_cache_block_copies_round_trip():
    cache = KVCache(2, 4, 2, 1, 3, torch.float32)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    k, v = cache.read_blocks(torch.tensor([2, 0]))
    cache.write_blocks(torch.tensor([1, 3]), k, v)
    assert torch.equal(cache.k[:, 1], cache.k[:, 2]) and torch.equal(cache.v[:, 3], cache.v[:, 0])


# --- host tier ----------------------------------------------------------------------------------
def test_host_store_allocates_and_returns_memory_by_chunk():
    host = HostStore(capacity=5, nbytes=16, chunk_slots=2)
    assert host.bytes_allocated == 0
    slots = [host.reserve() for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4] and host.reserve() is None
    assert host.bytes_allocated == 5 * 16
    host.view(3).fill_(7)
    for slot in (2, 3):
        host.release(slot)
    assert host.bytes_allocated == 3 * 16  # chunk 1 is empty and gone
    assert host.reserve() == 2
    with pytest.raises(ValueError):
        host.release(3)


# --- disk tier ----------------------------------------------------------------------------------
LAYOUT = DiskLayout("ab" * 16, "full", "2x4x2x8:float32", 64)


def _payload(fill: int) -> bytes:
    return bytes([fill]) * 64


def _store(tmp_path, layout=LAYOUT, capacity=8) -> DiskStore:
    return DiskStore(tmp_path, layout, capacity)


def test_disk_store_survives_a_restart(tmp_path):
    disk = _store(tmp_path)
    slots = [disk.reserve() for _ in range(3)]
    for i, slot in enumerate(slots):
        disk.write(slot, bytes([i]) * 16, 4, ((b"\x09" * 16, 2),), _payload(i))
    disk.release(slots[1])
    disk.close()
    again = _store(tmp_path)
    assert sorted(again.records) == [slots[0], slots[2]] and again.repaired == 0
    assert again.records[slots[2]].aliases == ((b"\x09" * 16, 2),)
    assert bytes(again.read(slots[2], bytes([2]) * 16)) == _payload(2)
    assert again.reserve() == slots[1]  # the deleted slot is free again
    again.close()


def test_disk_store_detects_corruption_and_a_wrong_key(tmp_path):
    disk = _store(tmp_path)
    slot = disk.reserve()
    disk.write(slot, b"k" * 16, 4, (), _payload(5))
    with open(disk.dir / "blocks.dat", "r+b") as f:
        f.seek(slot * 64 + 10)
        f.write(b"\0")
    with pytest.raises(ChecksumError):
        disk.read(slot, b"k" * 16)
    with pytest.raises(ChecksumError):
        disk.read(slot, b"x" * 16)
    disk.close()


def test_torn_journal_is_repaired_on_open(tmp_path):
    disk = _store(tmp_path)
    for i in range(2):
        disk.write(disk.reserve(), bytes([i]) * 16, 4, (), _payload(i))
    disk.close()
    journal = disk.dir / "index.log"
    journal.write_bytes(journal.read_bytes() + b"P 2 " + b"cd" * 16)  # a process killed mid-line
    again = _store(tmp_path)
    assert sorted(again.records) == [0, 1] and again.repaired == 1
    assert b"P 2" not in journal.read_bytes()  # the journal was rewritten compact
    again.close()


def test_another_layout_never_reads_the_folder(tmp_path, caplog):
    disk = _store(tmp_path)
    disk.write(disk.reserve(), b"k" * 16, 4, (), _payload(1))
    disk.close()
    other = _store(tmp_path, DiskLayout("cd" * 16, "full", "2x4x2x8:float32", 64))
    assert other.records == {} and other.dir != disk.dir
    other.close()
    # A folder whose meta.json says something else (another model, a damaged file) starts afresh.
    (disk.dir / "meta.json").write_text('{"format": 1, "fingerprint": "other"}')
    with caplog.at_level(logging.WARNING):
        again = _store(tmp_path)
    assert again.records == {} and "another model" in caplog.text
    again.close()


def test_one_process_at_a_time(tmp_path):
    disk = _store(tmp_path)
    with pytest.raises(DiskBusyError):
        _store(tmp_path)
    disk.close()
    _store(tmp_path).close()


def test_full_disk_stops_writing_and_keeps_reading(tmp_path, monkeypatch):
    disk = _store(tmp_path)
    disk.write(disk.reserve(), b"k" * 16, 4, (), _payload(1))

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("edgeinfer.kv.disk.os.pwrite", no_space)
    slot = disk.reserve()
    with pytest.raises(OSError):
        disk.write(slot, b"j" * 16, 4, (), _payload(2))
    disk.release(slot)
    assert not disk.writable and disk.reserve() is None
    assert bytes(disk.read(0, b"k" * 16)) == _payload(1)
    disk.close()


def test_default_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "edgeinfer" / "kv"


def test_embedding_store_round_trip_and_damage(tmp_path):
    store = EmbeddingStore(tmp_path)
    x = torch.randn(5, 3).to(torch.bfloat16)
    store.store("h1", x)
    assert torch.equal(store.load("h1"), x)
    path = tmp_path / "h1.emb"
    path.write_bytes(path.read_bytes()[:-2] + b"zz")
    assert store.load("h1") is None and not path.exists()
    assert store.load("absent") is None


def test_embedding_store_writes_in_the_background_and_warns_once(tmp_path, caplog):
    worker = SpillWorker()
    store = EmbeddingStore(tmp_path / "vision", worker, max_files=2)
    for i in range(3):
        store.store(f"h{i}", torch.full((2, 2), float(i)))
    worker.drain()
    assert len(list((tmp_path / "vision").glob("*.emb"))) == 2  # pruned to max_files
    (tmp_path / "vision").rename(tmp_path / "gone")  # the folder vanishes under it
    (tmp_path / "vision").write_text("a file, not a folder")
    with caplog.at_level(logging.WARNING):
        store.store("h3", torch.zeros(1))
        store.store("h4", torch.zeros(1))
        worker.drain()
    assert caplog.text.count("cannot write the vision cache") == 1
    worker.close()


# --- worker ---------------------------------------------------------------------------------------
def test_worker_runs_urgent_jobs_first_and_reports_errors():
    worker = SpillWorker()
    gate, order = threading.Event(), []
    first = worker.submit(Job(gate.wait, urgent=False))
    background = worker.submit(Job(lambda: order.append("background"), urgent=False))
    urgent = worker.submit(Job(lambda: order.append("urgent"), urgent=True))
    failing = worker.submit(Job(lambda: 1 / 0, urgent=True))
    gate.set()
    worker.drain()
    assert order == ["urgent", "background"]
    assert isinstance(failing.error, ZeroDivisionError) and urgent.error is None
    assert {id(j) for j in worker.finished()} == {id(j) for j in (first, background, urgent, failing)}
    worker.close()


def test_waiting_on_a_queued_job_runs_it_on_the_caller():
    worker = SpillWorker()
    gate = threading.Event()
    worker.submit(Job(gate.wait, urgent=True))
    ran_on = []
    job = worker.submit(Job(lambda: ran_on.append(threading.current_thread().name), urgent=True))
    worker.wait(job)  # the worker is stuck on the first job: this one runs here
    assert ran_on == [threading.current_thread().name]
    gate.set()
    worker.close()


# --- metrics ----------------------------------------------------------------------------------------
def test_histogram_is_cumulative():
    h = Histogram()
    for seconds in (0.0001, 0.003, 0.003, 7.0):
        h.observe(seconds)
    cumulative = dict(h.cumulative())
    assert cumulative["0.0005"] == 1 and cumulative["0.005"] == 3 and cumulative["+Inf"] == 4
    assert h.count == 4


def test_collector_registers_on_the_given_registry(checkpoint):
    from prometheus_client import CollectorRegistry, generate_latest

    from edgeinfer.engine import Engine, EngineConfig

    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=16, host_tier_mb=1))
    registry = CollectorRegistry()
    register_kv_metrics(registry, engine.kv_metrics)
    text = generate_latest(registry).decode()
    assert 'edgeinfer_kv_usage_ratio{tier="host"}' in text
    assert 'edgeinfer_kv_blocks{state="free",tier="device"} 16.0' in text
    assert "edgeinfer_kv_restore_seconds_bucket" in text and "edgeinfer_kv_prefix_hit_ratio" in text
    names = {name for name, _, _ in engine.kv_metrics()}  # the snapshot is also (name, labels, value) triples
    assert {"edgeinfer_kv_usage_ratio", "edgeinfer_kv_blocks", "edgeinfer_kv_recomputes_total"} <= names
    engine.close()
