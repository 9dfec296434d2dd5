"""Speed and memory of ``ckptkit convert ddp.pt out/ --max-shard-size SIZE`` against ``cp``.

    python benchmarks/bench_shards.py --runs 3                   # ~1 GiB, interleaved runs
    python benchmarks/bench_shards.py --gib 4 --runs 1 --only-memory

The checkpoint, the process timing, the RssAnon sampling and the re-read of the input before
each run are bench_convert's (imported, not copied); the single-file convert runs alongside.
Each round times every command once, in turn, the order reversed every other round, so drift
on a shared machine hits them alike; the two converts are also compared round by round. The
table gives min/median/max wall seconds. ckptkit fsyncs what it writes (durable); ``cp`` does
not, hence also ``cp && sync``. Each convert is set against the cp of the same output shape:
the single file against ``cp ddp.pt``, the shards against ``cp -r`` of the same shard files
(made once, untimed), since making several files durable costs more than one whatever writes them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_convert import (
    add_common_args,
    compile_ckptkit,
    make_checkpoint,
    paired,
    rounds,
    run,
    spread,
    warm,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, runs=3, only_memory="only the ckptkit convert (for big --gib)")
    ap.add_argument(
        "--max-shard-size", default="200MB", help="shard size for ckptkit (default: 200MB, ~5 shards a GiB)"
    )
    args = ap.parse_args()
    compile_ckptkit()
    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptkit-bench-"))
    try:
        pt, _ = make_checkpoint(scratch, args.gib)
        out, copy, single, ref, ref_copy = (scratch / n for n in ("out", "copy.pt", "single.pt", "ref", "ref_copy"))
        ck = [sys.executable, "-m", "ckptkit.cli", "convert", str(pt)]
        shard_args = ["--max-shard-size", args.max_shard_size]
        subprocess.run([*ck, f"{ref}/", *shard_args], check=True, capture_output=True)  # the same files, for cp -r
        refs = sorted(ref.iterdir())
        # (name, command, inputs to re-read, baseline rows: the cp of one file, or of the same shard files)
        cases = [
            ("cp ddp.pt", ["cp", str(pt), str(copy)], [pt], ""),
            ("cp ddp.pt && sync", ["sh", "-c", f"cp {pt} {copy} && sync {copy}"], [pt], ""),
            ("ckptkit convert ddp.pt single.pt", [*ck, str(single)], [pt], "file"),
            ("cp -r shards/", ["cp", "-r", str(ref), str(ref_copy)], refs, ""),
            ("cp -r shards/ && sync", ["sh", "-c", f"cp -r {ref} {ref_copy} && sync {ref_copy}/*"], refs, ""),
            (
                f"ckptkit convert ddp.pt out/ --max-shard-size {args.max_shard_size}",
                [*ck, f"{out}/", *shard_args],
                [pt],
                "shards",
            ),
        ]
        if args.only_memory:
            cases = cases[-1:]
        results: dict[str, list[tuple[float, int]]] = {c[0]: [] for c in cases}
        for name, cmd, inputs, _ in rounds(cases, args.runs):
            for target in (out, ref_copy):
                shutil.rmtree(target, ignore_errors=True)
            copy.unlink(missing_ok=True)
            single.unlink(missing_ok=True)
            os.sync()  # no dirty pages left over from the previous command to slow this one
            for path in inputs:  # re-read untimed right before each run: a daemon here evicts idle page cache
                warm(path)
            results[name].append(run(cmd))
        size = pt.stat().st_size
        print(
            f"\ncheckpoint: {size / 2**30:.2f} GiB ({size:,} bytes); {args.runs} interleaved run(s); ckptkit writes {len(refs)} files"
        )
        print("x cp: against the cp of the same output shape (one file, or the same shard files)\n")
        print("| command | min / median / max s | x cp | x cp && sync | peak RssAnon MiB |")
        print("|---|---|---:|---:|---:|")
        med = {name: statistics.median(t for t, _ in rs) for name, rs in results.items()}
        base = {"file": ("cp ddp.pt", "cp ddp.pt && sync"), "shards": ("cp -r shards/", "cp -r shards/ && sync")}
        for name, _, _, kind in cases:
            times = [t for t, _ in results[name]]
            xs = [f"{med[name] / med[b]:.2f}" if b in med else "" for b in base.get(kind, ("", ""))]
            print(f"| {name} | {spread(times)} | {xs[0]} | {xs[1]} | {max(m for _, m in results[name])} |")
        if not args.only_memory:
            single_name, shards_name = cases[2][0], cases[-1][0]
            times = {name: [t for t, _ in results[name]] for name in (single_name, shards_name)}
            print("\n" + paired(shards_name, times[shards_name], single_name, times[single_name]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
