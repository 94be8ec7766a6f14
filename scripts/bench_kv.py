#!/usr/bin/env python3
"""Benchmark the KV spill manager: resume from host and disk against recomputing, decode overhead,
eight sessions round robin under a squeezed pool, transformers' offloading cache as the peer on CUDA.

    python scripts/bench_kv.py --out bench-results/
    python scripts/bench_kv.py --parts resume,overhead --repeats 5

Builds a random SmolVLM-256M-shaped checkpoint once under --cache (or takes --model), runs
on CUDA when it is there, and writes kv.json and kv.md under --out.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.bench.kv import main

if __name__ == "__main__":
    main()
