"""Tile choices kept across processes: one file per GPU and build, entries by kind and key, and
nothing a broken or unwritable file can do beyond a warning and a tuning."""

from __future__ import annotations

import json
import multiprocessing
import sys
import warnings
from pathlib import Path

import pytest

from edgeinfer import tile_cache
from edgeinfer.tile_cache import TILE_CACHE_ENV, TileCache

H200 = {"gpu": "NVIDIA H200", "capability": [9, 0], "multiprocessors": 132, "l2_bytes": 62914560,
        "torch": "2.11.0", "cuda": "12.8", "triton": "3.5.0", "kernels": "a" * 64, "schema": tile_cache.SCHEMA}
ORIN = {**H200, "gpu": "Orin (nvgpu)", "capability": [8, 7], "multiprocessors": 16, "l2_bytes": 4194304}
KEY = {"products": {"qkv": {"shape": [2048, 1536], "bits": 4}}, "layers": 28}
TILES = {"configs": {"qkv": {"packed": True, "bn": 16, "bk": 2048, "warps": 4, "split": 1, "registers": None}},
         "step_budget_s": 8.0}


@pytest.fixture(autouse=True)
def fresh_reads():
    """Every test reads the files as a new process would."""
    tile_cache.forget_reads()
    yield
    tile_cache.forget_reads()


def test_a_choice_stored_by_one_process_is_found_by_the_next(tmp_path):
    TileCache(tmp_path).put("fused-step", KEY, TILES, H200)
    tile_cache.forget_reads()
    assert TileCache(tmp_path).get("fused-step", KEY, H200) == TILES
    [path] = tmp_path.glob("*.json")
    assert path.name.startswith("nvidia-h200-") and path == TileCache(tmp_path).path(H200)
    data = json.loads(path.read_text())
    assert data["identity"] == H200 and len(data["entries"]) == 1


def test_another_gpu_kernel_build_kind_or_key_finds_nothing(tmp_path):
    cache = TileCache(tmp_path)
    cache.put("fused-step", KEY, TILES, H200)
    assert cache.get("fused-step", KEY, ORIN) is None
    assert cache.get("fused-step", KEY, {**H200, "kernels": "b" * 64}) is None  # a changed kernel source
    assert cache.get("fused-step", KEY, {**H200, "triton": "3.6.0"}) is None
    assert cache.get("packed-mm", KEY, H200) is None
    assert cache.get("fused-step", {**KEY, "layers": 24}, H200) is None
    assert cache.get("fused-step", KEY, H200) == TILES
    assert len({cache.path(ident) for ident in (H200, ORIN, {**H200, "kernels": "b" * 64})}) == 3


def test_entries_of_one_identity_accumulate_and_a_new_value_replaces_the_old(tmp_path):
    cache = TileCache(tmp_path)
    cache.put("fused-step", KEY, TILES, H200)
    cache.put("packed-mm", {"n": 512, "row_tile": 16}, {"bn": 64}, H200)
    cache.put("packed-mm", {"n": 512, "row_tile": 16}, {"bn": 32}, H200)
    tile_cache.forget_reads()
    assert cache.get("fused-step", KEY, H200) == TILES
    assert cache.get("packed-mm", {"n": 512, "row_tile": 16}, H200) == {"bn": 32}
    assert len(json.loads(cache.path(H200).read_text())["entries"]) == 2


def test_off_keeps_nothing(tmp_path):
    cache = TileCache(None)
    cache.put("fused-step", KEY, TILES, H200)
    assert cache.get("fused-step", KEY, H200) is None and cache.path(H200) is None


def test_the_environment_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(TILE_CACHE_ENV, str(tmp_path / "tiles"))
    assert tile_cache.default().folder == tmp_path / "tiles"
    monkeypatch.setenv(TILE_CACHE_ENV, " OFF ")
    assert tile_cache.default().folder is None
    monkeypatch.delenv(TILE_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tile_cache.default().folder == tmp_path / "xdg" / "edgeinfer" / "tiles"


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), json.dumps({"identity": ORIN, "entries": {}}),
                                     json.dumps({"identity": H200, "entries": "none"})],
                         ids=["not-json", "not-an-object", "another-identity", "entries-not-an-object"])
def test_a_broken_or_foreign_file_is_a_warning_and_a_miss_and_the_next_choice_mends_it(tmp_path, content):
    cache = TileCache(tmp_path)
    path = cache.path(H200)
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring the tile cache"):
        assert cache.get("fused-step", KEY, H200) is None
    cache.put("fused-step", KEY, TILES, H200)
    tile_cache.forget_reads()
    assert cache.get("fused-step", KEY, H200) == TILES


def test_an_entry_whose_key_differs_from_its_digest_is_not_taken(tmp_path):
    cache = TileCache(tmp_path)
    cache.put("fused-step", KEY, TILES, H200)
    data = json.loads(cache.path(H200).read_text())
    [entry] = data["entries"].values()
    entry["key"] = {**KEY, "layers": 1}
    cache.path(H200).write_text(json.dumps(data))
    tile_cache.forget_reads()
    assert cache.get("fused-step", KEY, H200) is None


def test_a_folder_that_cannot_be_written_is_a_warning_not_an_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = TileCache(blocker / "tiles")  # under a regular file: no one can create it
    with pytest.warns(UserWarning, match="tile choices not kept"):
        cache.put("fused-step", KEY, TILES, H200)
    assert cache.get("fused-step", KEY, H200) is None


def _put_many(folder: str, worker: int, count: int) -> None:
    cache = TileCache(Path(folder))
    for i in range(count):
        cache.put("packed-mm", {"worker": worker, "i": i}, {"bn": i}, H200)


def test_processes_storing_at_once_always_leave_a_whole_file(tmp_path):
    """Each store renames a whole file over the last: a reader never sees half a file, and each
    process's own last entry survives its own rename (another's may be lost, and timed again)."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_put_many, args=(str(tmp_path), w, 40)) for w in range(2)]
    for p in workers:
        p.start()
    seen = 0
    while any(p.is_alive() for p in workers):
        path = TileCache(tmp_path).path(H200)
        if path.exists():
            json.loads(path.read_text())  # never a torn write
            seen += 1
    for p in workers:
        p.join()
        assert p.exitcode == 0
    data = json.loads(TileCache(tmp_path).path(H200).read_text())
    assert data["identity"] == H200
    keys = [entry["key"] for entry in data["entries"].values()]
    assert {"worker": 0, "i": 39} in keys or {"worker": 1, "i": 39} in keys
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"


def test_the_kernels_digest_covers_every_kernel_module_s_source():
    for name in tile_cache.KERNEL_MODULES:
        assert name in sys.modules or __import__(name)
    package = Path(tile_cache.__file__).parent
    with_kernels = {".".join(("edgeinfer", *path.relative_to(package).with_suffix("").parts))
                    for path in package.rglob("*.py")
                    if "@triton.jit" in (text := path.read_text(encoding="utf-8")) or "@gluon.jit" in text}
    assert with_kernels and with_kernels <= set(tile_cache.KERNEL_MODULES), \
        f"kernels whose source the tiles' identity does not read: {sorted(with_kernels - set(tile_cache.KERNEL_MODULES))}"
    import edgeinfer.backends.torch.triton_decode as module

    assert Path(module.__file__).read_bytes()  # the digest reads the files themselves
    assert len(tile_cache.kernels_digest()) == 64


def test_a_source_digest_changes_with_the_source(tmp_path, monkeypatch):
    (tmp_path / "probe_kernels_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = tile_cache.sources_digest(("probe_kernels_mod",))
    (tmp_path / "probe_kernels_mod.py").write_text("X = 2\n")
    assert tile_cache.sources_digest(("probe_kernels_mod",)) != before
    assert tile_cache.sources_digest(("no_such_module_anywhere",)) != before


def test_warnings_are_given_once_per_message(tmp_path):
    cache = TileCache(tmp_path)
    cache.path(H200).write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.get("fused-step", KEY, H200)
        tile_cache.forget_reads()
        cache.get("fused-step", KEY, H200)
    assert len([w for w in caught if "ignoring the tile cache" in str(w.message)]) == 1


class Heard:
    """:class:`edgeinfer.progress.Steps` that keeps each phase as [description, total, steps done]."""

    def __init__(self) -> None:
        self.phases: list[list] = []

    def phase(self, description, total):
        entry = [description, total, 0]
        self.phases.append(entry)

        def advance():
            entry[2] += 1
        return advance


def fused_step(checkpoint, family: str = "qwen2_vl"):
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.models.loader import load_model

    decoder = load_model(checkpoint(family)).decoder
    _relayout(decoder, out_major=True)
    return triton_decode.FusedDecode(decoder)


@pytest.fixture
def timers(monkeypatch):
    """The device's two timers replaced by known costs and counted, every tile's outputs taken as
    right (the GPU is the boundary), and this machine given a GPU's identity: the o product's third
    tile wins in the step."""
    import itertools

    from edgeinfer.backends.torch import triton_decode

    calls = {"alone": 0, "step": 0}
    alone_times = itertools.count(1.0)

    def alone_us(fns):
        calls["alone"] += 1
        return float(next(alone_times))

    def step_us(step):
        calls["step"] += 1
        return 950.0 if fused_configs()["o"] == triton_decode.GEMV_CANDIDATES[2] else 1000.0

    current = {}

    def fused_configs():
        return current["fused"].configs

    monkeypatch.setattr(triton_decode, "graph_time_us", alone_us)
    monkeypatch.setattr(triton_decode, "step_time_us", step_us)
    # every tile's outputs taken as torch's: the kernels do not run here
    monkeypatch.setattr(triton_decode, "right_tiles", lambda x, w, tiles, out, run, **kw: (list(tiles), {}))
    monkeypatch.setattr(triton_decode, "device_identity", lambda device: H200)
    return calls, current


def test_the_fused_step_takes_the_tiles_an_earlier_process_chose_and_times_nothing(checkpoint, timers, tmp_path):
    from edgeinfer.backends.torch import triton_decode

    calls, current = timers
    heard = Heard()
    first = current["fused"] = fused_step(checkpoint)
    first.tune(step_budget_s=60, cache=TileCache(tmp_path), steps=heard)
    assert first.tiles_source == "timed" and calls["alone"] > 0 and calls["step"] > 0
    assert first.configs["o"] == triton_decode.GEMV_CANDIDATES[2]
    # the progress bars hear every timing: alone against a known total, in the step as they come
    total = 5 * len(triton_decode.GEMV_CANDIDATES)  # five dense products (cuBLAS's timings are not tiles)
    assert heard.phases == [[triton_decode.TILES_ALONE, total, total],
                            [triton_decode.TILES_IN_STEP, None, calls["step"]]]

    tile_cache.forget_reads()
    timed = dict(calls)
    heard = Heard()
    second = current["fused"] = fused_step(checkpoint)
    second.tune(step_budget_s=8, cache=TileCache(tmp_path), steps=heard)
    assert calls == timed and not heard.phases, "nothing is timed when the cache holds the step's tiles"
    assert second.tiles_source == "cache"
    assert second.configs == first.configs
    assert second.report == first.report and second.step_report == first.step_report


def test_a_longer_step_tuning_another_model_or_no_cache_times_again(checkpoint, timers, tmp_path):
    calls, current = timers
    current["fused"] = fused_step(checkpoint)
    current["fused"].tune(step_budget_s=8, cache=TileCache(tmp_path))
    for family, budget, cache in [("qwen2_vl", 60, TileCache(tmp_path)), ("smolvlm", 8, TileCache(tmp_path)),
                                  ("qwen2_vl", 8, TileCache(None))]:
        before = dict(calls)
        current["fused"] = fused_step(checkpoint, family)
        current["fused"].tune(step_budget_s=budget, cache=cache)
        assert current["fused"].tiles_source == "timed", (family, budget, cache.folder)
        assert calls["alone"] > before["alone"]


def test_kept_tiles_of_the_wrong_kind_or_incomplete_are_not_taken(checkpoint, timers):
    calls, current = timers
    fused = current["fused"] = fused_step(checkpoint)
    fused.tune(step_budget_s=0)
    kept = fused.kept(8.0)
    assert fused_step(checkpoint).restore(json.loads(json.dumps(kept)), 8.0)
    assert {c["kind"] for c in kept["configs"].values()} == {"dense"}
    from_before_kinds = json.loads(json.dumps(kept))
    for config in from_before_kinds["configs"].values():
        del config["kind"]  # a file kept before tiles named their kernel: read by its "packed" alone
    assert fused_step(checkpoint).restore(from_before_kinds, 8.0)
    packed_kind = json.loads(json.dumps(kept))
    packed_kind["configs"]["qkv"]["packed"] = True  # a packed tile for a dense product
    staged_kind = json.loads(json.dumps(kept))
    staged_kind["configs"]["o"]["kind"] = "staged"  # the staged kernel's tile for a dense product
    missing = json.loads(json.dumps(kept))
    del missing["configs"]["down"]
    unknown_field = json.loads(json.dumps(kept))
    unknown_field["configs"]["o"]["tiles"] = 3
    for bad in (packed_kind, staged_kind, missing, unknown_field, {}):
        other = fused_step(checkpoint)
        assert not other.restore(bad, 8.0) and other.configs == {} and other.tiles_source is None


def test_the_key_names_each_product_s_shape_and_format(checkpoint):
    key = fused_step(checkpoint).tiles_key()
    assert set(key["products"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert key["products"]["gate_up"]["glu"] and key["products"]["o"]["residual"]
    assert fused_step(checkpoint, "smolvlm").tiles_key() != key


def test_the_key_names_whether_the_integer_dot_tiles_were_timed(checkpoint, monkeypatch):
    """Tiles timed with the integer-dot tiles switched off are not restored with them on, nor the other way round."""
    from edgeinfer.quant.launching import INTEGER_DOT_ENV

    monkeypatch.delenv(INTEGER_DOT_ENV, raising=False)
    key = fused_step(checkpoint).tiles_key()
    monkeypatch.setenv(INTEGER_DOT_ENV, "0")
    off = fused_step(checkpoint).tiles_key()
    assert key["integer_dot"] is True and off["integer_dot"] is False and off != key
