"""``ckptkit convert`` to and from ``s3://`` against s3fs's own ``get``/``put`` of the same bytes.

    python benchmarks/bench_s3.py               # ~1 GiB checkpoint, 3 interleaved rounds
    python benchmarks/bench_s3.py --gib 0.25 --runs 5
    python benchmarks/bench_s3.py --direction folder   # a prefix of Hugging Face shards, read

Against a local S3 server (moto, started here on 127.0.0.1, answering a ranged GET by reading
only its range, as S3 does), so the figures compare the client side (CRC-32s, the commit check)
with s3fs's plain transfer, not a network. ckptkit's convert does more than the transfer:
s3 -> local reads the object through ranged GETs as it converts it (every tensor byte
CRC-checked, fsynced); local -> s3 converts into a streamed multipart upload and checks the
store's CRC-32 of the object. s3fs's ``get_file``/``put_file`` move the bytes with its defaults
(one GET; 50 MiB parts, up to 10 at once). Each command is a whole process; the
commands are interleaved, min/median/max reported, with peak ``RssAnon`` (private memory).
Needs ``pip install 'ckptkit[s3]' moto``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_convert import compile_ckptkit, paired, rounds, run, spread, warm  # noqa: E402

BUCKET = "ckptkit-bench"
S3FS_GET = "import sys, s3fs; s3fs.S3FileSystem().get_file(sys.argv[1], sys.argv[2])"
S3FS_PUT = "import sys, s3fs; s3fs.S3FileSystem().put_file(sys.argv[1], sys.argv[2])"
S3FS_GET_FOLDER = "import sys, s3fs; s3fs.S3FileSystem().get(sys.argv[1] + '/', sys.argv[2] + '/', recursive=True)"


def make_checkpoint(path: Path, gib: float) -> None:
    """A DDP-style state dict of a few large fp32 tensors, about ``gib`` GiB (untimed)."""
    import torch

    n = int(gib * 2**30 / 4 / 4)
    g = torch.Generator().manual_seed(0)
    torch.save(
        {f"module.layer{i}.weight": torch.randn(n, generator=g) for i in range(4)} | {"module.bias": torch.zeros(7)},
        path,
    )


def start_server() -> tuple[object, str]:
    """moto, answering a ranged GET by reading its range as S3 does (tests/s3stores.WithS3Ranges):
    moto itself reads the whole object for each ranged GET."""
    from tests import s3stores

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log: one line per request
    return s3stores.start(ranges=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument(
        "--direction",
        choices=["both", "up", "down", "folder"],
        default="both",
        help="up or down: the uploads or the downloads only; folder: a prefix of 4 shards, read",
    )
    args = ap.parse_args()
    server, endpoint = start_server()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        OMP_NUM_THREADS="1",
    )
    root = Path(__file__).resolve().parent.parent
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])
    import s3fs

    s3fs.S3FileSystem().mkdir(BUCKET)
    scratch = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=args.dir))
    os.environ["CKPTKIT_STAGING"] = str(scratch)
    try:
        compile_ckptkit()
        src = scratch / "ddp.pt"
        make_checkpoint(src, args.gib)
        size = src.stat().st_size
        url = f"s3://{BUCKET}/ddp.pt"
        if args.direction == "folder":  # the same weights as a prefix of Hugging Face shards, untimed
            shards = scratch / "hf"
            run(
                [
                    sys.executable,
                    "-m",
                    "ckptkit.cli",
                    "convert",
                    str(src),
                    str(shards),
                    "--max-shard-size",
                    str(size // 4 + 1),
                ]
            )
            s3fs.S3FileSystem().put(f"{shards}/", f"s3://{BUCKET}/hf/", recursive=True)
        elif args.direction != "up":
            s3fs.S3FileSystem().put_file(str(src), url)  # the s3 -> local source, untimed
        py = sys.executable
        cases = {
            "ckptkit convert s3:// -> local": [
                py,
                "-m",
                "ckptkit.cli",
                "convert",
                url,
                str(scratch / "out.pt"),
                "--force",
            ],
            "s3fs get_file": [py, "-c", S3FS_GET, url, str(scratch / "got.pt")],
            "ckptkit convert local -> s3://": [
                py,
                "-m",
                "ckptkit.cli",
                "convert",
                str(src),
                f"s3://{BUCKET}/single.pt",
                "--force",
            ],
            "s3fs put_file": [py, "-c", S3FS_PUT, str(src), f"s3://{BUCKET}/put.pt"],
        }
        if args.direction == "folder":
            cases = {
                "ckptkit convert s3://prefix -> local": [
                    *cases["ckptkit convert s3:// -> local"][:4],
                    f"s3://{BUCKET}/hf",
                    str(scratch / "out.safetensors"),
                    "--force",
                ],
                "s3fs get (recursive)": [py, "-c", S3FS_GET_FOLDER, f"s3://{BUCKET}/hf", str(scratch / "got")],
            }
        elif args.direction == "up":
            cases = {k: v for k, v in cases.items() if "-> s3://" in k or "put_file" in k}
        elif args.direction == "down":
            cases = {k: v for k, v in cases.items() if "s3:// ->" in k or "get_file" in k}
        times: dict[str, list[float]] = {name: [] for name in cases}
        mems: dict[str, int] = dict.fromkeys(cases, 0)
        for name in rounds(list(cases), args.runs):
            warm(src)
            t, mem = run(cases[name])
            times[name].append(t)
            mems[name] = max(mems[name], mem)
            for leftover in ("out.pt", "got.pt", "out.safetensors"):
                (scratch / leftover).unlink(missing_ok=True)
            shutil.rmtree(scratch / "got", ignore_errors=True)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = {
            "ckptkit convert s3:// -> local": "s3fs get_file",
            "ckptkit convert local -> s3://": "s3fs put_file",
            "ckptkit convert s3://prefix -> local": "s3fs get (recursive)",
        }
        print(
            f"\ncheckpoint: {size / 2**30:.2f} GiB ({size:,} bytes), local moto S3 server, {args.runs} interleaved run(s)"
        )
        print("| command | min / median / max s | x s3fs | peak RssAnon MiB |")
        print("|---|---|---:|---:|")
        for name, ts in times.items():
            ratio = f"{med[name] / med[base[name]]:.2f}" if name in base else "1.00"
            print(f"| {name} | {spread(ts)} | {ratio} | {mems[name]} |")
        print()
        for name, other in base.items():
            if name in times:
                print(paired(name, times[name], other, times[other]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
