"""Wall and CPU time of ckptkit's checked copy (``fileio.copy_range``) when the bytes land at
another offset within a page than in their source, by ``copy_file_range`` and by ``splice``
through a 1 MiB pipe (``io/kcopy.py``), against the same copy page for page. The pipe is
taken on ext4 alone: elsewhere its row shows 0 splice calls and measures copy_file_range.

    python benchmarks/bench_kcopy.py --runs 10 --dir /path/on/the/disk

Each run copies ``--gib`` GiB from a source offset of 1728 bytes into a page (where a torch.save
zip record's data may start) to a fresh file, CRC-32 checked as convert checks it, then fsyncs:
``congruent`` lands each byte at its source's offset within a page (copy_file_range), ``pipe``
and ``copy_file_range`` 64 bytes off it (a safetensors shard's tensors, a DCP chunk). Rounds
alternate the order; the source is re-read (untimed) before each run, as this machine evicts
idle file pages. CPU is the process's user + system time: the kernel's copy and the writeback
this thread starts, and the CRC thread.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_convert import spread  # noqa: E402
from ckptkit.io import (
    fileio,
    kcopy,  # noqa: E402
)

SRC_AT = (1 << 20) + 1728


def copy(src: Path, dst: Path, pad: int, length: int) -> tuple[float, float]:
    """(wall s, CPU s) of a checked copy of ``length`` bytes from SRC_AT to ``dst`` after ``pad``
    bytes, fsynced."""
    with open(src, "rb") as f:  # re-read untimed: a daemon here evicts idle page cache
        while f.read(64 << 20):
            pass
    ru, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with open(src, "rb") as s, open(dst, "wb") as d:
        d.write(bytes(pad))
        fileio.copy_range(s, d, SRC_AT, length, crc=True)
        os.fsync(d.fileno())
    wall, ru2 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    dst.unlink()
    return wall, ru2.ru_utime + ru2.ru_stime - ru.ru_utime - ru.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder on the disk to measure")
    args = ap.parse_args()
    length = int(args.gib * 2**30)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckptkit-bench-") as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        block = random.Random(0).randbytes(64 << 20)
        with open(src, "wb") as f:
            for _ in range(0, SRC_AT + length, len(block)):
                f.write(block)
        pipe_from = kcopy._SPLICE_FROM
        cases = {  # name: (bytes before the copy in dst, the shortest range that may take the pipe)
            "congruent (copy_file_range)": (SRC_AT % 4096, pipe_from),
            "64 B off, copy_file_range": (SRC_AT % 4096 + 64, 1 << 62),
            "64 B off, pipe (ckptkit)": (SRC_AT % 4096 + 64, pipe_from),
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        spliced = dict.fromkeys(cases, 0)
        real_splice = os.splice
        for r in range(args.runs):
            names = list(cases)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each case first, middle and last in turn
                pad, kcopy._SPLICE_FROM = cases[name]

                def counting(*a: Any, _name: str = name, **k: Any) -> int:
                    spliced[_name] += 1
                    return real_splice(*a, **k)

                os.splice = counting
                try:
                    results[name].append(copy(src, dst, pad, length))
                finally:
                    os.splice, kcopy._SPLICE_FROM = real_splice, pipe_from
    where = args.dir or "a temp folder"
    print(f"\n{length / 2**30:.2f} GiB checked copy + fsync, {args.runs} interleaved run(s) in {where}\n")
    print("| copy | wall min / median / max s | CPU min / median / max s | wall, run by run, x congruent | splices |")
    print("|---|---|---|---:|---:|")
    base = [w for w, _ in results["congruent (copy_file_range)"]]
    for name, rs in results.items():
        walls, cpus = [w for w, _ in rs], [c for _, c in rs]
        ratio = statistics.median(w / b for w, b in zip(walls, base, strict=True))
        print(f"| {name} | {spread(walls)} | {spread(cpus)} | {ratio:.3f} | {spliced[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
