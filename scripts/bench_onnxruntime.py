#!/usr/bin/env python3
"""`edgeinfer bench onnxruntime`, for checkouts without the command installed: every argument is passed on.

    python scripts/bench_onnxruntime.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.cli.main import app  # noqa: E402

if __name__ == "__main__":
    app(["bench", "onnxruntime", *sys.argv[1:]], prog_name="edgeinfer")
