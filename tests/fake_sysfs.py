"""Fake machines for detection tests: real files under a temporary root, laid out like
``/proc``, ``/sys`` and ``/etc`` on the machines they stand for."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def write(root: Path, path: str, text: str | bytes) -> Path:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        target.write_bytes(text)
    else:
        target.write_text(text)
    return target


def meminfo(total_mb: int, available_mb: int, free_mb: int | None = None, swap_mb: int = 0) -> str:
    free = available_mb // 4 if free_mb is None else free_mb
    kb = lambda mb: f"{mb * 1024:>8} kB"  # noqa: E731
    return (f"MemTotal:       {kb(total_mb)}\nMemFree:        {kb(free)}\n"
            f"MemAvailable:   {kb(available_mb)}\nBuffers:        {kb(64)}\n"
            f"Cached:         {kb(available_mb - free)}\nSwapTotal:      {kb(swap_mb)}\n"
            f"SwapFree:       {kb(swap_mb)}\n")


@dataclass(frozen=True)
class JetsonBoard:
    profile: str
    model: str
    compatible: tuple[str, ...]
    memtotal_mb: int
    l4t: tuple[int, str] = (36, "4.3")
    modes: tuple[tuple[int, str], ...] = ((0, "MAXN"), (1, "MODE_30W"), (2, "MODE_15W"))


# Model strings and compatible entries as L4T's device trees publish them;
# MemTotal as the kernel reports it (a little under the module's size).
JETSON_BOARDS = (
    JetsonBoard("agx-thor", "NVIDIA Jetson AGX Thor Developer Kit",
                ("nvidia,p3971-0000+p3834-0000", "nvidia,p3834-0000", "nvidia,tegra264"), 125_652, (38, "2.0"),
                ((0, "MAXN"), (1, "120W"), (2, "90W"))),
    JetsonBoard("agx-orin-64gb", "NVIDIA Jetson AGX Orin Developer Kit",
                ("nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005", "nvidia,tegra234"), 62_841),
    JetsonBoard("agx-orin-32gb", "NVIDIA Jetson AGX Orin",
                ("nvidia,p3737-0000+p3701-0004", "nvidia,p3701-0004", "nvidia,tegra234"), 30_536),
    JetsonBoard("orin-nx-16gb", "NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
                ("nvidia,p3768-0000+p3767-0000", "nvidia,p3767-0000", "nvidia,tegra234"), 15_656,
                modes=((0, "MAXN"), (1, "10W"), (2, "15W"), (3, "25W"))),
    JetsonBoard("orin-nx-8gb", "NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
                ("nvidia,p3768-0000+p3767-0001", "nvidia,p3767-0001", "nvidia,tegra234"), 7_620),
    JetsonBoard("orin-nano-8gb", "NVIDIA Jetson Orin Nano Developer Kit",
                ("nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005", "nvidia,tegra234"), 7_620, (36, "3.0"),
                ((0, "15W"), (1, "7W"))),
    JetsonBoard("orin-nano-8gb", "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
                ("nvidia,p3768-0000+p3767-0005-super", "nvidia,p3767-0005", "nvidia,tegra234"), 7_620, (36, "4.3"),
                ((0, "15W"), (1, "25W"), (2, "MAXN_SUPER"), (3, "7W"))),
    JetsonBoard("orin-nano-4gb", "NVIDIA Jetson Orin Nano Developer Kit",
                ("nvidia,p3768-0000+p3767-0004", "nvidia,p3767-0004", "nvidia,tegra234"), 3_420),
)


@dataclass
class Jetson:
    board: JetsonBoard
    available_mb: int | None = None
    mode: int = 0
    clocks_locked: bool = False
    swaps: tuple[tuple[str, int], ...] = (("/dev/zram0", 1024),)
    thermal: dict[str, int] = field(default_factory=lambda: {"cpu-thermal": 48_500, "gpu-thermal": 47_000,
                                                              "tj-thermal": 49_100, "unused": -256_000})

    def build(self, root: Path) -> Path:
        board = self.board
        available = self.available_mb if self.available_mb is not None else board.memtotal_mb * 3 // 4
        write(root, "/proc/device-tree/model", board.model.encode() + b"\x00")
        write(root, "/proc/device-tree/compatible", b"".join(c.encode() + b"\x00" for c in board.compatible))
        major, revision = board.l4t
        write(root, "/etc/nv_tegra_release",
              f"# R{major} (release), REVISION: {revision}, GCID: 38968081, BOARD: generic, EABI: aarch64, "
              f"DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\n")
        write(root, "/proc/meminfo", meminfo(board.memtotal_mb, available, swap_mb=sum(s for _, s in self.swaps)))
        self._power(root)
        self._swaps(root)
        self._thermal(root)
        return root

    def _power(self, root: Path) -> None:
        modes = "".join(f"< POWER_MODEL ID={i} NAME={name} >\nCPU_ONLINE CORE_0 1\n\n" for i, name in self.board.modes)
        write(root, "/etc/nvpmodel.conf", f"< PM_CONFIG DEFAULT={self.board.modes[-1][0]} >\n\n{modes}")
        write(root, "/var/lib/nvpmodel/status", f"pmode:{self.mode:04d} fmode:quiet\n")
        for cpu in range(2):
            base = f"/sys/devices/system/cpu/cpu{cpu}/cpufreq"
            write(root, f"{base}/cpuinfo_max_freq", "1984000\n")
            write(root, f"{base}/scaling_min_freq", "1984000\n" if self.clocks_locked else "729600\n")
        gpu = "/sys/class/devfreq/17000000.gpu"
        write(root, f"{gpu}/max_freq", "1020000000\n")
        write(root, f"{gpu}/min_freq", "1020000000\n" if self.clocks_locked else "306000000\n")
        write(root, f"{gpu}/cur_freq", "612000000\n")
        hwmon = "/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
        rails = (("VDD_IN", 5000, 1400), ("VDD_CPU_GPU_CV", 5000, 400), ("VDD_SOC", 5000, 300),
                 ("sum of shunt voltages", 0, 0))
        for channel, (name, mv, ma) in enumerate(rails, start=1):
            write(root, f"{hwmon}/in{channel}_label", name + "\n")
            write(root, f"{hwmon}/in{channel}_input", f"{mv}\n")
            write(root, f"{hwmon}/curr{channel}_input", f"{ma}\n")

    def _swaps(self, root: Path) -> None:
        lines = "".join(f"{name}\t{'partition' if 'zram' in name else 'file'}\t{mb * 1024}\t0\t5\n"
                        for name, mb in self.swaps)
        write(root, "/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + lines)

    def _thermal(self, root: Path) -> None:
        for i, (name, millis) in enumerate(self.thermal.items()):
            write(root, f"/sys/class/thermal/thermal_zone{i}/type", name + "\n")
            write(root, f"/sys/class/thermal/thermal_zone{i}/temp", f"{millis}\n")


def make_dgpu(root: Path, name: str = "NVIDIA GeForce RTX 4090", total_mb: int = 64_000) -> Path:
    write(root, "/proc/meminfo", meminfo(total_mb, total_mb // 2))
    write(root, "/proc/driver/nvidia/version",
          "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
          "GCC version:  gcc version 12.3.0\n")
    write(root, "/proc/driver/nvidia/gpus/0000:01:00.0/information",
          f"Model: \t\t {name}\nIRQ:   \t\t 150\nGPU UUID: \t GPU-5d5b0c1e\nVideo BIOS: \t 95.02.18.80.87\n"
          "Bus Type: \t PCIe\nDMA Size: \t 47 bits\n")
    write(root, "/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n/swap.img\tfile\t8388604\t0\t-2\n")
    return root


def make_cpu(root: Path, total_mb: int = 16_000, available_mb: int | None = None) -> Path:
    write(root, "/proc/meminfo", meminfo(total_mb, total_mb // 2 if available_mb is None else available_mb))
    write(root, "/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n")
    return root
