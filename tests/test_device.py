"""Detection and power readings over fake /proc + /sys + /etc trees (real files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeinfer.device import (
    CudaProbe,
    detect_device,
    jetpack_for_l4t,
    read_l4t_version,
    read_memory,
    read_swaps,
    tensorrt_matches_jetpack,
)
from edgeinfer.power import read_clocks, read_power_mode, read_power_snapshot, read_sysfs_rails, read_thermal_zones

try:
    from tests.fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, make_dgpu, meminfo, write
except ImportError:
    from fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, make_dgpu, meminfo, write


@pytest.mark.parametrize("board", JETSON_BOARDS, ids=lambda b: f"{b.profile}:{b.model[-12:]}")
def test_detects_every_jetson_class(tmp_path: Path, board) -> None:
    info = detect_device(Jetson(board).build(tmp_path))
    assert info.kind == "jetson"
    assert info.unified
    assert info.model == board.model
    assert info.compatible == board.compatible
    assert info.l4t_version == f"{board.l4t[0]}.{board.l4t[1]}"
    assert info.memory_total_mb == board.memtotal_mb
    assert info.sm == ("11.0" if "Thor" in board.model else "8.7")
    assert info.jetpack is not None


def test_available_memory_is_memavailable_not_memfree(tmp_path: Path) -> None:
    write(tmp_path, "/proc/meminfo", meminfo(7620, available_mb=5000, free_mb=300))
    memory = read_memory(tmp_path)
    assert (memory.available_mb, memory.free_mb) == (5000, 300)
    assert detect_device(tmp_path).memory_available_mb == 5000


def test_old_kernels_without_memavailable_count_page_cache(tmp_path: Path) -> None:
    write(tmp_path, "/proc/meminfo", "MemTotal: 8192000 kB\nMemFree: 1024000 kB\nCached: 2048000 kB\n")
    assert read_memory(tmp_path).available_mb == 3000


def test_dgpu_box_from_driver_files(tmp_path: Path) -> None:
    info = detect_device(make_dgpu(tmp_path, "NVIDIA RTX A4000"))
    assert (info.kind, info.model, info.unified, info.driver_version) == ("cuda", "NVIDIA RTX A4000", False, "550.54.14")
    assert info.sm is None  # the driver's files do not say; the CUDA runtime does


def test_cuda_probe_fills_in_what_the_runtime_knows(tmp_path: Path) -> None:
    info = detect_device(make_dgpu(tmp_path), cuda_probe=lambda: CudaProbe("NVIDIA GeForce RTX 4090", "8.9", 24_076))
    assert (info.sm, info.cuda_memory_mb, info.cuda_device) == ("8.9", 24_076, "NVIDIA GeForce RTX 4090")


def test_cpu_box(tmp_path: Path) -> None:
    info = detect_device(make_cpu(tmp_path, total_mb=16_000))
    assert (info.kind, info.model, info.sm, info.unified) == ("cpu", None, None, False)
    assert info.memory_total_mb == 16_000


def test_empty_tree_is_a_cpu_box_with_unknown_memory(tmp_path: Path) -> None:
    info = detect_device(tmp_path)
    assert (info.kind, info.memory_total_mb) == ("cpu", 0)


def test_tegra_without_jetson_in_model_is_still_jetson(tmp_path: Path) -> None:
    write(tmp_path, "/proc/device-tree/model", b"Custom carrier\x00")
    write(tmp_path, "/proc/device-tree/compatible", b"acme,carrier\x00nvidia,tegra234\x00")
    write(tmp_path, "/proc/meminfo", meminfo(15_656, 12_000))
    info = detect_device(tmp_path)
    assert (info.kind, info.l4t_version) == ("jetson", None)


def test_real_machine_detects_consistently() -> None:
    info = detect_device("/")
    assert info.kind in ("jetson", "cuda", "cpu")
    assert 0 < info.memory_available_mb <= info.memory_total_mb


@pytest.mark.parametrize(("line", "version"), [
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic", "36.4.3"),
    ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref", "35.4.1"),
    ("garbage", None),
])
def test_l4t_release_line(tmp_path: Path, line: str, version: str | None) -> None:
    write(tmp_path, "/etc/nv_tegra_release", line + "\n")
    assert read_l4t_version(tmp_path) == version


@pytest.mark.parametrize(("l4t", "jetpack", "tensorrt"), [
    ("36.4.3", "6.2", "10.3"), ("36.4.0", "6.1", "10.3"), ("36.3.0", "6.0", "8.6"),
    ("35.4.1", "5.1.2", "8.5"), ("38.2.0", "7.0", "10.13"),
])
def test_jetpack_table_longest_prefix(l4t: str, jetpack: str, tensorrt: str) -> None:
    release = jetpack_for_l4t(l4t)
    assert (release.jetpack, release.tensorrt) == (jetpack, tensorrt)
    assert tensorrt_matches_jetpack(f"{tensorrt}.0.30", release)
    assert not tensorrt_matches_jetpack("9.9.0", release)


def test_unknown_l4t_has_no_jetpack() -> None:
    assert jetpack_for_l4t("32.7.4") is None
    assert jetpack_for_l4t(None) is None


def test_swaps_tell_zram_from_disk(tmp_path: Path) -> None:
    Jetson(JETSON_BOARDS[3], swaps=(("/dev/zram0", 1024), ("/ssd/swapfile", 16384))).build(tmp_path)
    swaps = read_swaps(tmp_path)
    assert [(s.name, s.size_mb, s.zram) for s in swaps] == [("/dev/zram0", 1024, True), ("/ssd/swapfile", 16384, False)]


# --------------------------------------------------------------------------- power and thermal


def test_thermal_zones_in_celsius_without_dead_sensors(tmp_path: Path) -> None:
    Jetson(JETSON_BOARDS[1]).build(tmp_path)
    zones = read_thermal_zones(tmp_path)
    assert [(z.name, z.temp_c) for z in zones] == [("cpu-thermal", 48.5), ("gpu-thermal", 47.0), ("tj-thermal", 49.1)]


def test_power_mode_maxn_and_below(tmp_path: Path) -> None:
    board = JETSON_BOARDS[3]  # Orin NX 16GB: MAXN, 10W, 15W, 25W
    at_max = read_power_mode(Jetson(board, mode=0).build(tmp_path / "a"))
    assert (at_max.name, at_max.is_max) == ("MAXN", True)
    throttled = read_power_mode(Jetson(board, mode=2).build(tmp_path / "b"))
    assert (throttled.name, throttled.is_max, throttled.max_mode) == ("15W", False, (0, "MAXN"))


def test_power_mode_without_maxn_takes_most_watts(tmp_path: Path) -> None:
    board = JETSON_BOARDS[5]  # Orin Nano on JetPack 6.0: 15W and 7W only
    mode = read_power_mode(Jetson(board, mode=0).build(tmp_path))
    assert (mode.max_mode, mode.is_max) == ((0, "15W"), True)


def test_no_nvpmodel_means_no_power_mode(tmp_path: Path) -> None:
    assert read_power_mode(make_cpu(tmp_path)) is None


@pytest.mark.parametrize("locked", [True, False])
def test_clocks_locked_by_jetson_clocks(tmp_path: Path, locked: bool) -> None:
    clocks = read_clocks(Jetson(JETSON_BOARDS[1], clocks_locked=locked).build(tmp_path))
    assert (clocks.cpu_locked, clocks.gpu_locked, clocks.locked) == (locked, locked, locked)
    assert (clocks.gpu_cur_mhz, clocks.gpu_max_mhz) == (612, 1020)


def test_rails_from_ina3221_skip_the_sum_channel(tmp_path: Path) -> None:
    rails = read_sysfs_rails(Jetson(JETSON_BOARDS[4]).build(tmp_path))
    assert [r.name for r in rails] == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]
    assert rails[0].watts == pytest.approx(7.0)


def test_snapshot_for_metrics(tmp_path: Path) -> None:
    snapshot = read_power_snapshot(Jetson(JETSON_BOARDS[1], mode=1).build(tmp_path))
    assert (snapshot.rails_source, snapshot.input_watts, snapshot.max_temp_c) == ("sysfs", pytest.approx(7.0), 49.1)
    names = {name for name, _, _ in snapshot.gauges()}
    assert names == {"edgeinfer_thermal_celsius", "edgeinfer_power_watts", "edgeinfer_power_mode",
                     "edgeinfer_clocks_locked"}


def test_snapshot_of_a_plain_box_is_empty_not_an_error(tmp_path: Path) -> None:
    snapshot = read_power_snapshot(make_cpu(tmp_path), use_jtop=False)
    assert (snapshot.mode, snapshot.thermal, snapshot.rails, snapshot.rails_source) == (None, (), (), "none")
    assert snapshot.input_watts is None and not snapshot.clocks.locked
