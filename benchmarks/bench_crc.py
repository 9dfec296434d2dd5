"""CRC-32 throughput of the implementations ckptkit could use, on one buffer in memory.

    python benchmarks/bench_crc.py                 # 256 MiB, 7 runs each
    python benchmarks/bench_crc.py --mib 64 --runs 3

Every byte ckptkit checks goes through ``ckptkit.io.fileio.crc32``: ISA-L's (the ``isal``
package) where a wheel exists, ``zlib.crc32`` elsewhere. The others are measured where they are
installed (``zlib-ng``, ``deflate``) and skipped otherwise. All must give the same value; the
table gives MB/s (10**6 bytes a second), min / median / max over the runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable

CANDIDATES = [
    ("`zlib.crc32` (Python's)", "zlib", "crc32"),
    ("`isal.isal_zlib.crc32` (ISA-L)", "isal.isal_zlib", "crc32"),
    ("`zlib_ng.zlib_ng.crc32`", "zlib_ng.zlib_ng", "crc32"),
    ("`deflate.crc32` (libdeflate)", "deflate", "crc32"),
]


def available() -> list[tuple[str, Callable[[bytes], int]]]:
    found = []
    for label, module, name in CANDIDATES:
        try:
            found.append((label, getattr(importlib.import_module(module), name)))
        except (ImportError, AttributeError):
            print(f"bench_crc: {module} is not installed; skipped", file=sys.stderr)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    data = os.urandom(args.mib << 20)
    impls = available()
    values = {label: fn(data) & 0xFFFFFFFF for label, fn in impls}
    if len(set(values.values())) != 1:
        print(f"bench_crc: the implementations disagree: {values}", file=sys.stderr)
        return 1
    rates: dict[str, list[float]] = {label: [] for label, _ in impls}
    for r in range(args.runs):  # interleaved, the order reversed every other round
        for label, fn in impls if r % 2 == 0 else impls[::-1]:
            t0 = time.perf_counter()
            fn(data)
            rates[label].append(len(data) / 1e6 / (time.perf_counter() - t0))
    print(f"{args.mib} MiB in memory, {args.runs} interleaved runs each; every implementation gave the same value\n")
    print("| implementation | MB/s min | median | max |")
    print("|---|---:|---:|---:|")
    for label, xs in rates.items():
        print(f"| {label} | {min(xs):.0f} | {statistics.median(xs):.0f} | {max(xs):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
