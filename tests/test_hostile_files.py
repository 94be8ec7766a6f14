"""Persisted cache files under hostile conditions: damaged, copied over, or on a full filesystem.

A vision-cache file or a disk-tier journal is read back by every later process, so any
damage must end in a warning and a recompute, never a crash and never another image's
answer. A full filesystem is made at the outermost boundary (``os.statvfs``, the journal's
``open``, ``os.pwrite``), never by mocking the store under test.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.kv.disk import (
    DiskFullError,
    DiskLayout,
    DiskStore,
    FreeSpace,
    open_disk_tier,
)
from edgeinfer.kv.embeddings import EmbeddingStore, encode_entry
from tests.conftest import noise_image

LAYOUT = DiskLayout("ab" * 16, "full", "2x4x2x8:float32", 64)
FORCED = SamplingParams(max_new_tokens=8, min_new_tokens=8)
QUESTION = "what is in the image ?"
IMAGE_A, IMAGE_B = noise_image(128, 96, seed=1), noise_image(128, 96, seed=2)


def _payload(fill: int) -> bytes:
    return bytes([fill]) * 64


def _header(meta: object) -> bytes:
    return EmbeddingStore.MAGIC + json.dumps(meta).encode() + b"\n"


# --- vision cache files ------------------------------------------------------------------------
def _sound(key: str = "h1", owner: str = "") -> bytes:
    return encode_entry(key, owner, torch.arange(6, dtype=torch.float32).view(2, 3))


DAMAGED = {
    "header is a JSON list": lambda: _header([1, 2, 3]) + b"\0" * 24,
    "header is a JSON string": lambda: _header("crc") + b"\0" * 24,
    "dtype names a torch attribute": lambda: _header({"key": "h1", "owner": "", "dtype": "nn", "shape": [2, 3],
                                                      "crc": 0}) + b"\0" * 24,
    "dtype is a list": lambda: _header({"key": "h1", "owner": "", "dtype": ["float32"], "shape": [2, 3],
                                        "crc": 0}) + b"\0" * 24,
    "shape holds a bool": lambda: _header({"key": "h1", "owner": "", "dtype": "float32", "shape": [True, 3],
                                           "crc": 0}) + b"\0" * 12,
    "shape is negative": lambda: _header({"key": "h1", "owner": "", "dtype": "float32", "shape": [-2, 3],
                                          "crc": 0}),
    "crc is a string": lambda: _header({"key": "h1", "owner": "", "dtype": "float32", "shape": [2, 3],
                                        "crc": "0"}) + b"\0" * 24,
    "header not UTF-8": lambda: EmbeddingStore.MAGIC + b"{\xff\xfe}\n" + b"\0" * 24,
    "header cut short": lambda: _sound()[:20],
    "values cut short": lambda: _sound()[:-4],
    "one value flipped": lambda: _sound()[:-1] + b"\x7f",
    "an older format": lambda: b"EIEMB1\n" + _sound()[len(EmbeddingStore.MAGIC):],
    "empty file": lambda: b"",
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_vision_cache_file_is_a_warning_and_a_miss(tmp_path, caplog, damage):
    store = EmbeddingStore(tmp_path)
    path = tmp_path / "h1.emb"
    path.write_bytes(DAMAGED[damage]())
    assert store.verify("h1") is not None  # checking changes nothing
    assert path.exists()
    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv"):
        assert store.load("h1") is None
    assert not path.exists() and "cannot be used" in caplog.text
    store.store("h1", torch.ones(2, 3))  # the image is encoded again and stored afresh
    assert torch.equal(store.load("h1"), torch.ones(2, 3)) and store.verify("h1") is None


def test_a_file_copied_over_another_images_file_is_never_used(tmp_path, caplog):
    store = EmbeddingStore(tmp_path, owner="model-1")
    store.store("image-a", torch.zeros(4, 3))
    store.store("image-b", torch.ones(4, 3))
    shutil.copy(tmp_path / "image-a.emb", tmp_path / "image-b.emb")
    assert store.verify("image-b") == "written for another image or another model"
    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv"):
        assert store.load("image-b") is None
    assert torch.equal(store.load("image-a"), torch.zeros(4, 3))
    assert sorted(store.keys()) == ["image-a"]


def test_a_file_from_another_models_folder_is_never_used(tmp_path):
    EmbeddingStore(tmp_path / "m1", owner="model-1").store("image-a", torch.zeros(4, 3))
    (tmp_path / "m2").mkdir()
    shutil.copy(tmp_path / "m1" / "image-a.emb", tmp_path / "m2" / "image-a.emb")
    assert EmbeddingStore(tmp_path / "m2", owner="model-2").load("image-a") is None


def test_a_full_filesystem_stops_vision_cache_writes_with_one_warning(tmp_path, caplog):
    store = EmbeddingStore(tmp_path, free_space=FreeSpace(tmp_path, margin=2**62))
    with pytest.raises(DiskFullError):
        store.write("h0", torch.zeros(2))
    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv"):
        for i in range(3):
            store.store(f"h{i}", torch.zeros(2))
    assert store.stopped and caplog.text.count("cannot write the vision cache") == 1
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


# --- the disk tier on a full filesystem ---------------------------------------------------------
def _filled(tmp_path, n: int = 3) -> DiskStore:
    disk = DiskStore(tmp_path, LAYOUT, 8)
    for i in range(n):
        disk.write(disk.reserve(), bytes([i]) * 16, 4, (), _payload(i))
    return disk


def _no_space_for_new_files(monkeypatch):
    """``open`` for writing in the disk module creates the file, then the disk is full."""
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode:
            real_open(path, mode).close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("edgeinfer.kv.disk.open", full, raising=False)


def test_a_full_disk_at_open_keeps_the_tier_reading_its_blocks(tmp_path, monkeypatch, caplog):
    disk = _filled(tmp_path)
    disk.release(1)  # a D line: the next open wants to compact the journal
    disk.close()
    _no_space_for_new_files(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv"):
        again = open_disk_tier(tmp_path, LAYOUT, 8)
    assert again is not None, "a full disk must not drop the whole tier"
    assert sorted(again.records) == [0, 2] and bytes(again.read(2, bytes([2]) * 16)) == _payload(2)
    assert not again.writable and again.reserve() is None and "old one is kept" in caplog.text
    assert not (again.dir / "index.tmp").exists()  # no 0-byte temporary index left behind
    again.close()
    monkeypatch.undo()
    later = DiskStore(tmp_path, LAYOUT, 8)  # space again: the journal is compacted and writes resume
    assert sorted(later.records) == [0, 2] and later.writable
    assert (later.dir / "index.log").read_bytes().count(b"\n") == 2
    later.close()


def test_a_compact_journal_is_not_rewritten_at_open(tmp_path, monkeypatch):
    _filled(tmp_path).close()
    _no_space_for_new_files(monkeypatch)
    again = DiskStore(tmp_path, LAYOUT, 8)
    assert again.writable and sorted(again.records) == [0, 1, 2]
    again.close()


def test_a_torn_journal_on_a_full_disk_is_cut_after_its_last_sound_line(tmp_path, monkeypatch):
    _filled(tmp_path, 2).close()
    journal = tmp_path / "v1" / LAYOUT.digest() / "index.log"
    sound = journal.read_bytes()
    journal.write_bytes(sound + b"P 2 " + b"cd" * 16)  # a process killed mid-line
    _no_space_for_new_files(monkeypatch)
    again = DiskStore(tmp_path, LAYOUT, 8)
    assert journal.read_bytes() == sound and again.repaired == 1 and sorted(again.records) == [0, 1]
    again.close()
    monkeypatch.undo()
    later = DiskStore(tmp_path, LAYOUT, 8)
    later.write(later.reserve(), b"n" * 16, 4, (), _payload(9))  # appended on a line of its own
    later.close()
    assert sorted(DiskStore(tmp_path, LAYOUT, 8).records) == [0, 1, 2]


def _filesystem(monkeypatch, free_blocks: list[int], frsize: int = 64, blocks: int = 1000):
    """A filesystem of ``blocks`` blocks whose free count is ``free_blocks[0]`` (change it to fill it)."""
    def statvfs(path):
        return SimpleNamespace(f_frsize=frsize, f_blocks=blocks, f_bavail=free_blocks[0])

    monkeypatch.setattr("edgeinfer.kv.disk.os.statvfs", statvfs)


def test_the_tier_opens_no_larger_than_the_free_margin_allows(tmp_path, monkeypatch):
    _filesystem(monkeypatch, [53])  # margin: 5% of 1000 blocks = 50; 3 blocks of room
    disk = DiskStore(tmp_path, LAYOUT, 8)
    assert disk.capacity == 3
    disk.close()
    disk = DiskStore(tmp_path, LAYOUT, 8, free_margin=0)  # an explicit margin
    assert disk.capacity == 8
    disk.close()


def test_a_store_that_would_go_past_the_margin_turns_the_tier_read_only(tmp_path, monkeypatch):
    free = [60]
    _filesystem(monkeypatch, free)
    disk = DiskStore(tmp_path, LAYOUT, 8)
    disk.write(disk.reserve(), b"a" * 16, 4, (), _payload(1))
    free[0] = 50  # someone else filled the filesystem to its margin
    slot = disk.reserve()
    with pytest.raises(DiskFullError):
        disk.write(slot, b"b" * 16, 4, (), _payload(2))
    disk.release(slot)
    assert not disk.writable and disk.reserve() is None
    assert bytes(disk.read(0, b"a" * 16)) == _payload(1) and disk.verify(0) is None
    disk.close()


def test_a_delete_the_full_disk_refuses_keeps_the_block_valid(tmp_path, monkeypatch):
    disk = _filled(tmp_path, 2)

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("edgeinfer.kv.disk.os.write", no_space)
    disk.release(0)  # no exception for the engine's thread
    assert not disk.writable
    disk.close()
    monkeypatch.undo()
    again = DiskStore(tmp_path, LAYOUT, 8)
    assert sorted(again.records) == [0, 1] and again.verify(0) is None
    again.close()


def test_verify_names_a_damaged_block_and_changes_nothing(tmp_path):
    disk = _filled(tmp_path, 2)
    with open(disk.dir / "blocks.dat", "r+b") as f:
        f.seek(64 + 3)
        f.write(b"\xee")
    assert disk.verify(0) is None and "checksum" in disk.verify(1) and "no block" in disk.verify(5)
    assert sorted(disk.records) == [0, 1]
    disk.close()


# --- through the engine ------------------------------------------------------------------------
def engine_on(path, disk_dir):
    return Engine.load(path, config=EngineConfig(num_blocks=64, disk_tier_mb=4, disk_dir=str(disk_dir)))


@pytest.fixture(scope="module")
def cold(checkpoint):
    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(num_blocks=64))
    return {name: engine.generate(QUESTION, [image], FORCED).token_ids
            for name, image in (("a", IMAGE_A), ("b", IMAGE_B))}


def _vision_files(engine: Engine) -> dict[str, object]:
    folder = engine.kv_manager.embeddings.dir
    return {path.stem: path for path in folder.glob("*.emb")}


def _forget_kv_blocks(engine: Engine) -> None:
    """Keep only the vision files, so a later engine must use them (no KV block answers for them)."""
    for name in ("blocks.dat", "index.log"):
        (engine.kv_manager.disk.dir / name).unlink()


def test_a_vision_file_whose_header_is_not_an_object_is_recomputed(checkpoint, cold, tmp_path, caplog):
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE_A], FORCED)
    first.close()
    [path] = _vision_files(first).values()
    path.write_bytes(EmbeddingStore.MAGIC + b"[1, 2, 3]\n" + path.read_bytes().partition(b"\n")[2].partition(b"\n")[2])
    for _ in range(2):  # every later run answers, not only the first
        again = engine_on(checkpoint("smolvlm"), tmp_path)
        with caplog.at_level(logging.WARNING):
            assert again.generate(QUESTION, [IMAGE_A], FORCED).token_ids == cold["a"]
        again.close()
    assert "cannot be used" in caplog.text


def test_a_vision_file_copied_over_another_images_file_gives_that_images_answer(checkpoint, cold, tmp_path):
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE_A], FORCED)
    first.generate(QUESTION, [IMAGE_B], FORCED)
    first.close()
    first_file, second_file = _vision_files(first).values()
    _forget_kv_blocks(first)
    first_bytes = first_file.read_bytes()
    first_file.write_bytes(second_file.read_bytes())  # each image's file now holds the other's
    second_file.write_bytes(first_bytes)
    again = engine_on(checkpoint("smolvlm"), tmp_path)
    assert again.generate(QUESTION, [IMAGE_A], FORCED).token_ids == cold["a"]
    assert again.generate(QUESTION, [IMAGE_B], FORCED).token_ids == cold["b"]
    assert again.counters["vision_runs"] == 2  # neither swapped file was used
    again.close()


def test_stored_embeddings_of_the_wrong_size_are_recomputed(checkpoint, cold, tmp_path, caplog):
    first = engine_on(checkpoint("smolvlm"), tmp_path)
    first.generate(QUESTION, [IMAGE_A], FORCED)
    first.close()
    [(key, path)] = _vision_files(first).items()
    stored = first.kv_manager.embeddings
    path.write_bytes(encode_entry(key, stored.owner, torch.zeros(3, 8)))  # sound file, wrong token count
    again = engine_on(checkpoint("smolvlm"), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert again.generate(QUESTION, [IMAGE_A], FORCED).token_ids == cold["a"]
    assert again.counters["vision_runs"] == 1 and "encoded again" in caplog.text
    again.close()
