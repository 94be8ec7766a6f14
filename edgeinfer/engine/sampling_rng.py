"""Counter-based random numbers for sampling: one uniform per (request seed, step).

A draw's random number is a pure function of the request's seed and the index of the
token being drawn (how many tokens the request generated before it), never of a
generator's state. So a seeded request draws the same numbers alone or in any batch,
after a preemption, on replay, and inside a captured decode step that runs many steps
before the host looks.

The function is SplitMix64 (Steele, Lea and Flood, 2014) written in int64 torch ops:
wrapping multiplication and addition, logical right shifts as an arithmetic shift under a
mask. Those ops give the same bits on every device torch runs on, and
:func:`reference_uniform` computes the same value in plain Python. The uniform of
``(seed, counter)`` is the ``counter + 1``-th output of SplitMix64 started from
``mix64(seed)``, its top 24 bits scaled into [0, 1): exact in float32.
"""

from __future__ import annotations

import secrets

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
UNIFORM_BITS = 24  # float32 holds every multiple of 2**-24 in [0, 1) exactly


def as_int64(value: int) -> int:
    """``value`` modulo 2**64 as a signed 64-bit integer (two's complement): what an int64 tensor holds."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def fresh_seed() -> int:
    """A seed for a request that gave none, drawn once at admission: 64 bits from the OS."""
    return secrets.randbits(64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 ``x``, element-wise, wrapping as unsigned 64-bit arithmetic does."""
    x = (x ^ _shift_right(x, 30)) * as_int64(_M1)
    x = (x ^ _shift_right(x, 27)) * as_int64(_M2)
    return x ^ _shift_right(x, 31)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B] float32 uniforms in [0, 1) for int64 ``seeds`` [B] and ``counters`` [B], on their device."""
    state = mix64(seeds) + (counters + 1) * as_int64(_GOLDEN)
    bits = _shift_right(mix64(state), 64 - UNIFORM_BITS)
    return bits.to(torch.float32) * 2.0 ** -UNIFORM_BITS


def _mix64_int(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def reference_uniform(seed: int, counter: int) -> float:
    """The uniform of ``(seed, counter)`` in plain Python integers: the value :func:`uniforms` gives."""
    state = (_mix64_int(seed) + (counter + 1) * _GOLDEN) & _MASK64
    return (_mix64_int(state) >> (64 - UNIFORM_BITS)) * 2.0 ** -UNIFORM_BITS
