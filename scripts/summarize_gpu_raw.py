#!/usr/bin/env python3
"""The summary of `edgeinfer bench gpu` raw files, derived again from their runs by the present method.

    python scripts/summarize_gpu_raw.py RAW.json [RAW.json ...]

Prints, for each file, the Markdown summary `edgeinfer bench gpu` writes beside a raw file
(medians, ratios, byte rooflines, the Jetson projection), computed from the file's own runs,
records and bandwidth probes. The raw files are read, never changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.bench.gpu import GpuReport, markdown  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="`edgeinfer bench gpu` raw JSON files")
    args = parser.parse_args(argv)
    for path in args.files:
        if len(args.files) > 1:
            sys.stdout.write(f"## {path}\n\n")
        sys.stdout.write(markdown(GpuReport.from_raw(json.loads(path.read_text()))))


if __name__ == "__main__":
    main()
