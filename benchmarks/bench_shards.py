"""Speed and memory of ``ckptkit convert ddp.pt out/ --max-shard-size SIZE`` against ``cp``.

    python benchmarks/bench_shards.py --runs 3                   # ~1 GiB, interleaved runs
    python benchmarks/bench_shards.py --gib 4 --runs 1 --only-memory

The checkpoint, the process timing, the RssAnon sampling and the re-read of the input before
each run are bench_convert's (imported, not copied); the single-file convert runs alongside.
Each round times every command once, in turn, the order reversed every other round, so drift
on a shared machine hits them alike; the two converts are also compared round by round. The
table gives min/median/max wall seconds. ckptkit fsyncs each shard and the folder (durable);
``cp`` does not, hence also ``cp && sync``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_convert import (  # noqa: E402
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
    ap.add_argument("--max-shard-size", default="200MB", help="shard size for ckptkit (default: 200MB, ~5 shards a GiB)")
    args = ap.parse_args()
    compile_ckptkit()
    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptkit-bench-"))
    try:
        pt, _ = make_checkpoint(scratch, args.gib)
        warm(pt)
        out, copy, single = scratch / "out", scratch / "copy.pt", scratch / "single.pt"
        ck = [sys.executable, "-m", "ckptkit.cli", "convert", str(pt), f"{out}/", "--max-shard-size", args.max_shard_size]
        cases = [
            ("cp ddp.pt", ["cp", str(pt), str(copy)]),
            ("cp ddp.pt && sync", ["sh", "-c", f"cp {pt} {copy} && sync {copy}"]),
            ("ckptkit convert ddp.pt single.pt", [sys.executable, "-m", "ckptkit.cli", "convert", str(pt), str(single)]),
            (f"ckptkit convert ddp.pt out/ --max-shard-size {args.max_shard_size}", ck),
        ]
        if args.only_memory:
            cases = cases[3:]
        results: dict[str, list[tuple[float, int]]] = {name: [] for name, _ in cases}
        for name, cmd in rounds(cases, args.runs):
            shutil.rmtree(out, ignore_errors=True)
            copy.unlink(missing_ok=True)
            single.unlink(missing_ok=True)
            os.sync()  # no dirty pages left over from the previous command to slow this one
            warm(pt)  # re-read untimed right before each run: a daemon here evicts idle page cache
            results[name].append(run(cmd))
        shards = sorted(p.name for p in out.iterdir()) if out.exists() else []
        size = pt.stat().st_size
        print(f"\ncheckpoint: {size / 2**30:.2f} GiB ({size:,} bytes); {args.runs} interleaved run(s); ckptkit wrote {len(shards)} files\n")
        print("| command | min / median / max s | x cp | x cp && sync | peak RssAnon MiB |")
        print("|---|---|---:|---:|---:|")
        med = {name: statistics.median(t for t, _ in rs) for name, rs in results.items()}
        cp, cps = med.get("cp ddp.pt"), med.get("cp ddp.pt && sync")
        for name, rs in results.items():
            times = [t for t, _ in rs]
            x, xs = (f"{med[name] / cp:.2f}" if cp else ""), (f"{med[name] / cps:.2f}" if cps else "")
            print(f"| {name} | {spread(times)} | {x} | {xs} | {max(m for _, m in rs)} |")
        if not args.only_memory:
            (single_name, single_runs), (shards_name, shards_runs) = list(results.items())[2:]
            print("\n" + paired(shards_name, [t for t, _ in shards_runs], single_name, [t for t, _ in single_runs]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
