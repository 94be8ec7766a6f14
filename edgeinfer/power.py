"""Power and thermal readings: power mode, clocks, thermal zones and power rails.

:func:`read_power_snapshot` is what the daemon's metrics and the benchmarks sample.
Everything is read from files under ``root`` (nvpmodel's state, cpufreq/devfreq,
``/sys/class/thermal``, the INA3221 power monitors of Jetson boards); jetson-stats
(``jtop``) is asked for rails only on the real root and only where sysfs shows none.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from edgeinfer.device import is_real_root, read_text, under

_MODE_LINE = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)", re.IGNORECASE)
_STATUS_LINE = re.compile(r"pmode:\s*(\d+)", re.IGNORECASE)
_GPU_DEVFREQ = re.compile(r"gpu|ga10b|gb10b|gv11b", re.IGNORECASE)
_WATTS = re.compile(r"(\d+)W", re.IGNORECASE)
_GPU_MAX_FREQ = re.compile(r"^\s*GPU\s+MAX_FREQ\s+(-?\d+)", re.IGNORECASE | re.MULTILINE)
_INVALID_TEMP_C = -40.0  # zones without a sensor report large negative values


# --------------------------------------------------------------------------- power mode


@dataclass(frozen=True, slots=True)
class PowerMode:
    """The nvpmodel mode in force and the modes the board defines."""

    id: int
    name: str | None
    modes: tuple[tuple[int, str], ...]
    gpu_max_hz: int | None = None  # the GPU clock cap this mode sets; None: none (MAXN) or not said

    @property
    def max_mode(self) -> tuple[int, str] | None:
        """The fastest mode: MAXN (or MAXN_SUPER) where defined, else the most watts."""
        maxn = [(i, n) for i, n in self.modes if n.upper().startswith("MAXN")]
        rated = [(_watts(n), i, n) for i, n in self.modes if _watts(n) is not None]
        if maxn:
            return maxn[0]
        return max(rated)[1:] if rated else None

    @property
    def is_max(self) -> bool:
        best = self.max_mode
        if best is not None:
            return self.id == best[0]
        return bool(self.name) and self.name.upper().startswith("MAXN")


def _watts(name: str) -> int | None:
    match = _WATTS.search(name)
    return int(match.group(1)) if match else None


def read_power_modes(root: str | Path = "/") -> tuple[tuple[int, str], ...]:
    """``/etc/nvpmodel.conf``'s ``< POWER_MODEL ID=n NAME=... >`` lines."""
    text = read_text(root, "/etc/nvpmodel.conf") or ""
    return tuple((int(i), name) for i, name in _MODE_LINE.findall(text))


def read_mode_gpu_max_hz(root: str | Path, mode_id: int) -> int | None:
    """``GPU MAX_FREQ`` of mode ``mode_id`` in ``/etc/nvpmodel.conf``; None where it is absent or -1."""
    text = read_text(root, "/etc/nvpmodel.conf") or ""
    starts = [(m.start(), int(m.group(1))) for m in _MODE_LINE.finditer(text)]
    for i, (start, found) in enumerate(starts):
        if found == mode_id:
            end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
            match = _GPU_MAX_FREQ.search(text, start, end)
            hz = int(match.group(1)) if match else -1
            return hz if hz > 0 else None
    return None


def read_power_mode(root: str | Path = "/") -> PowerMode | None:
    """The current mode from nvpmodel's status file; None where nvpmodel is absent."""
    match = _STATUS_LINE.search(read_text(root, "/var/lib/nvpmodel/status") or "")
    if not match:
        return None
    modes = read_power_modes(root)
    current = int(match.group(1))
    return PowerMode(current, dict(modes).get(current), modes, read_mode_gpu_max_hz(root, current))


# --------------------------------------------------------------------------- clocks


@dataclass(frozen=True, slots=True)
class ClockState:
    """Whether jetson_clocks pinned the clocks (minimum raised to maximum).

    None where the clock files are absent.
    """

    cpu_locked: bool | None
    gpu_locked: bool | None
    gpu_cur_mhz: int | None
    gpu_max_mhz: int | None

    @property
    def locked(self) -> bool:
        return bool(self.cpu_locked) and bool(self.gpu_locked)


def _int_file(path: Path) -> int | None:
    text = read_text(path.parent, path.name)
    return int(text) if text and text.lstrip("-").isdigit() else None


def _cpu_locked(root: str | Path) -> bool | None:
    states = []
    for folder in sorted(under(root, "/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq")):
        low, high = _int_file(folder / "scaling_min_freq"), _int_file(folder / "cpuinfo_max_freq")
        if low is not None and high is not None:
            states.append(low >= high)
    return all(states) if states else None


def _gpu_devfreq(root: str | Path) -> Path | None:
    folders = sorted(under(root, "/sys/class/devfreq").glob("*"))
    return next((f for f in folders if _GPU_DEVFREQ.search(f.name)), None)


def read_clocks(root: str | Path = "/") -> ClockState:
    gpu = _gpu_devfreq(root)
    low = _int_file(gpu / "min_freq") if gpu else None
    high = _int_file(gpu / "max_freq") if gpu else None
    cur = _int_file(gpu / "cur_freq") if gpu else None
    gpu_locked = None if low is None or high is None else low >= high
    return ClockState(_cpu_locked(root), gpu_locked,
                      cur // 1_000_000 if cur else None, high // 1_000_000 if high else None)


# --------------------------------------------------------------------------- thermal


@dataclass(frozen=True, slots=True)
class ThermalZone:
    name: str
    temp_c: float


def read_thermal_zones(root: str | Path = "/") -> tuple[ThermalZone, ...]:
    """``/sys/class/thermal/thermal_zone*/{type,temp}``; temp is in milli-degrees C."""
    zones = []
    for folder in sorted(under(root, "/sys/class/thermal").glob("thermal_zone*"),
                         key=lambda p: (len(p.name), p.name)):
        millis = _int_file(folder / "temp")
        if millis is not None and millis / 1000 > _INVALID_TEMP_C:
            zones.append(ThermalZone(read_text(folder, "type") or folder.name, millis / 1000))
    return tuple(zones)


# --------------------------------------------------------------------------- power rails


@dataclass(frozen=True, slots=True)
class PowerRail:
    name: str
    volts: float
    amps: float

    @property
    def watts(self) -> float:
        return self.volts * self.amps


def read_sysfs_rails(root: str | Path = "/") -> tuple[PowerRail, ...]:
    """Rails of the INA3221 monitors: ``in<N>_label``, ``in<N>_input`` (mV), ``curr<N>_input`` (mA)."""
    rails = []
    for label in sorted(under(root, "/sys/bus/i2c/drivers/ina3221").glob("*/hwmon/hwmon*/in*_label")):
        channel = label.name.removeprefix("in").removesuffix("_label")
        name = read_text(label.parent, label.name) or ""
        millivolts = _int_file(label.parent / f"in{channel}_input")
        milliamps = _int_file(label.parent / f"curr{channel}_input")
        if name and "sum" not in name.lower() and millivolts is not None and milliamps is not None:
            rails.append(PowerRail(name, millivolts / 1000, milliamps / 1000))
    return tuple(rails)


def read_jtop_rails() -> tuple[PowerRail, ...]:
    """Rails through jetson-stats; empty where jtop or its service is missing."""
    try:
        from jtop import jtop
    except ImportError:
        return ()
    try:
        with jtop() as stats:
            rails = stats.power.get("rail", {})
    except Exception:  # noqa: BLE001 - jtop raises its own types when its service is down
        return ()
    return tuple(PowerRail(name, values.get("volt", 0) / 1000, values.get("curr", 0) / 1000)
                 for name, values in rails.items())


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class PowerSnapshot:
    taken_at: float
    mode: PowerMode | None
    clocks: ClockState
    thermal: tuple[ThermalZone, ...]
    rails: tuple[PowerRail, ...]
    rails_source: Literal["sysfs", "jtop", "none"]

    @property
    def max_temp_c(self) -> float | None:
        return max((zone.temp_c for zone in self.thermal), default=None)

    @property
    def input_watts(self) -> float | None:
        """Board input power: the VDD_IN rail where there is one, else the sum of rails."""
        board = [rail.watts for rail in self.rails if rail.name.upper() in ("VDD_IN", "VIN")]
        if board:
            return board[0]
        return sum(rail.watts for rail in self.rails) if self.rails else None

    def gauges(self) -> list[tuple[str, dict[str, str], float]]:
        """(metric name, labels, value) triples for a Prometheus exporter."""
        out = [("edgeinfer_thermal_celsius", {"zone": z.name}, z.temp_c) for z in self.thermal]
        out += [("edgeinfer_power_watts", {"rail": r.name}, r.watts) for r in self.rails]
        if self.mode is not None:
            out.append(("edgeinfer_power_mode", {"name": self.mode.name or str(self.mode.id)}, float(self.mode.id)))
        out.append(("edgeinfer_clocks_locked", {}, float(self.clocks.locked)))
        return out


def limits_reached(snapshot: PowerSnapshot, *, thermal_zone: str = ".*", thermal_limit_c: float | None = None,
                   power_budget_w: float | None = None, clock_cap_check: bool = False) -> tuple[str, ...]:
    """Which of the given limits the board is at, each said with its reading; empty when none.

    Thermal: a zone whose name matches ``thermal_zone`` at or above ``thermal_limit_c``. Power:
    board input at or above ``power_budget_w``. Clocks: the GPU's clock cap (devfreq
    ``max_freq``) under the cap the nvpmodel mode sets, which is how the kernel throttles.
    """
    reasons = []
    if thermal_limit_c is not None:
        pattern = re.compile(thermal_zone, re.IGNORECASE)
        hot = [z for z in snapshot.thermal if pattern.search(z.name) and z.temp_c >= thermal_limit_c]
        reasons += [f"{z.name} at {z.temp_c:.1f} C, limit {thermal_limit_c:g} C" for z in hot]
    watts = snapshot.input_watts
    if power_budget_w is not None and watts is not None and watts >= power_budget_w:
        reasons.append(f"board input {watts:.1f} W, budget {power_budget_w:g} W")
    mode, clocks = snapshot.mode, snapshot.clocks
    if clock_cap_check and mode is not None and mode.gpu_max_hz and clocks.gpu_max_mhz is not None \
            and clocks.gpu_max_mhz < mode.gpu_max_hz // 1_000_000:
        reasons.append(f"GPU clock cap {clocks.gpu_max_mhz} MHz, under mode {mode.name or mode.id}'s "
                       f"{mode.gpu_max_hz // 1_000_000} MHz")
    return tuple(reasons)


def read_power_snapshot(root: str | Path = "/", *, use_jtop: bool = True) -> PowerSnapshot:
    rails, source = read_sysfs_rails(root), "sysfs"
    if not rails and use_jtop and is_real_root(root):
        rails, source = read_jtop_rails(), "jtop"
    return PowerSnapshot(time.time(), read_power_mode(root), read_clocks(root), read_thermal_zones(root),
                         rails, source if rails else "none")
