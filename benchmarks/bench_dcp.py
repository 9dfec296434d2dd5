"""Speed and memory of ``ckptkit convert ckpt.dcp single.pt`` against ``cp -r`` of the folder.

    python benchmarks/bench_dcp.py --gib 1 --runs 3          # time, interleaved with cp -r
    python benchmarks/bench_dcp.py --gib 4 --only-memory     # peak private memory at 4 GiB
    python benchmarks/bench_dcp.py --gib 1 --mesh --naive    # a 2x2 mesh (2-D parallelism), and torch

The folder is saved by FSDP2 (``fully_shard``) on 2 gloo ranks: a GPT-like model (the shapes of
bench_convert.py's) built on the meta device, so each rank holds only its shards. Each run does
``cp -r``, ``cp -r && sync``, the convert to one file and to Hugging Face shards (by one process,
and by two with ``--workers 2``), and then the
same weights as one .pt file copied and converted (the single-file baseline), in turn, so a
change in the machine's load reaches all alike; each input is re-read right before its run;
the table gives min / median / max wall seconds and ratios to ``cp`` of the same input. Memory is the peak ``RssAnon``
(private memory, of the workers too) sampled as bench_convert.py does. ckptkit fsyncs what it writes; ``cp`` does not.
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
from benchmarks.bench_convert import add_common_args, compile_ckptkit, gpt_dims, paired, rounds, run, spread, warm  # noqa: E402

NAIVE = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def _save_rank(rank: int, world: int, rdzv: str, folder: str, gib: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    d, vocab, ff, layers = gpt_dims(gib)

    class Block(nn.Module):  # fully_shard wants modules with a forward; saving never calls it
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, ff), nn.Linear(ff, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.layers = nn.Embedding(vocab, d), nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = GPT()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(generator=g)
        dcp.save(model.state_dict(), checkpoint_id=folder)
        dist.barrier()  # neither rank tears gloo down while the other still uses it (seen: SIGABRT)
    finally:
        dist.destroy_process_group()


def _save_rank_2d(rank: int, world: int, rdzv: str, folder: str, gib: float) -> None:
    """The same model's weights as 2-D parallelism lays them out on a 2x2 mesh (FSDP over one
    dim, tensor parallelism over the other): each matrix sharded along both dims, alternately
    (Shard(0), Shard(1)) and (Shard(1), Shard(0)) as column- and row-parallel layers are; vectors
    along dim 0, replicated over the other."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    d, vocab, ff, layers = gpt_dims(gib)
    shapes = {"embed.weight": (vocab, d), "head.weight": (vocab, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(layers):
        block = {"qkv.weight": (3 * d, d), "proj.weight": (d, d), "up.weight": (ff, d), "down.weight": (d, ff)}
        block |= {"qkv.bias": (3 * d,), "proj.bias": (d,), "up.bias": (ff,), "down.bias": (d,)}
        shapes |= {f"layers.{i}.{k}": v for k, v in block.items()}
    # Each rank's pieces live in files it maps shared: the kernel can write them back and drop
    # them, so four ranks' pieces of a model as large as the machine's RAM need not fit in it.
    pieces = Path(folder).parent / f"pieces-{rank}"
    pieces.mkdir(exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        g = torch.Generator().manual_seed(0)  # every rank builds the same full tensor, then keeps its shard
        state = {}
        for i, (name, shape) in enumerate(shapes.items()):
            full = torch.randn(shape, generator=g)
            grid = [Shard(0), Shard(1)] if i % 2 else [Shard(1), Shard(0)]
            placements = grid if len(shape) == 2 else [Shard(0), Replicate()]
            dt = distribute_tensor(full, mesh, placements)
            local = dt.to_local()
            piece = torch.from_file(str(pieces / str(i)), shared=True, size=local.numel()).view(local.shape)
            piece.copy_(local)  # a Shard(0) piece was a view that kept the full tensor alive
            state[name] = DTensor.from_local(piece, mesh, placements, shape=dt.shape, stride=dt.stride())
        dcp.save(state, checkpoint_id=folder)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(pieces, ignore_errors=True)


def make_dcp(folder: Path, gib: float, *, mesh: bool = False) -> None:
    import torch.multiprocessing as mp

    ranks, save = (4, _save_rank_2d) if mesh else (2, _save_rank)
    # glibc raises its mmap threshold as large blocks are freed, then keeps freed tensors in its
    # heap: each rank's full tensors, built and dropped one by one, added up to the model's size.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # read by the ranks' C library at start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(save, args=(ranks, os.path.join(tmp, "rdzv"), str(folder), gib), nprocs=ranks, join=True)
    finally:  # the commands timed afterwards run as users run them
        del os.environ["MALLOC_MMAP_THRESHOLD_"]


def _clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()  # no dirty pages left over from the previous run to slow this one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, runs=3, only_memory="only ckptkit's converts of the folder, once (for big --gib)")
    ap.add_argument("--mesh", action="store_true", help="a 2x2 mesh's folder (2-D parallelism) instead of FSDP2's")
    ap.add_argument("--naive", action="store_true", help="also torch's dcp_to_torch_save (whole state dict in memory)")
    ap.add_argument(
        "--pair",
        action="store_true",
        help="only the folder -> one file and the same weights' one file -> one file, alternated; "
        "prints every run's time (this disk's 2-3 s outliers hide a 5%% difference in medians)",
    )
    ap.add_argument(
        "--folder-only",
        action="store_true",
        help="only the folder's rows, without the same weights as one file, each output removed after its run "
        "(for big --gib on a small disk)",
    )
    args = ap.parse_args()
    compile_ckptkit()
    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptkit-bench-dcp-"))
    try:
        src = scratch / "ckpt.dcp"
        make_dcp(src, args.gib, mesh=args.mesh)
        size = sum(p.stat().st_size for p in src.iterdir())
        copy, out, shards = scratch / "copy.dcp", scratch / "single.pt", scratch / "hf"
        resharded = scratch / "out.dcp"
        flat, flat_copy, flat_out = scratch / "flat.pt", scratch / "flat_copy.pt", scratch / "flat_out.pt"
        ckptkit = [sys.executable, "-m", "ckptkit.cli", "convert"]
        single_file = not args.only_memory and not args.folder_only
        if single_file:  # the same weights in one file, for the single-file baseline
            subprocess.run([*ckptkit, str(src), str(flat)], check=True, capture_output=True)
        dcp_in, pt_in = list(src.iterdir()), [flat]
        # (name, command, output to clear, inputs to re-read, baseline rows: cp, cp && sync)
        cases = [
            ("ckptkit convert ckpt.dcp single.pt", [*ckptkit, str(src), str(out)], out, dcp_in, "dcp"),
            (
                "ckptkit convert ckpt.dcp hf/ (200MB shards)",
                [*ckptkit, str(src), f"{shards}/", "--max-shard-size", "200MB"],
                shards,
                dcp_in,
                "dcp",
            ),
            (
                "ckptkit convert ckpt.dcp hf/ --workers 2 (200MB shards)",
                [*ckptkit, str(src), f"{shards}/", "--max-shard-size", "200MB", "--workers", "2"],
                shards,
                dcp_in,
                "dcp",
            ),
            (
                "ckptkit convert ckpt.dcp out.dcp --format dcp (one .distcp)",
                [*ckptkit, str(src), str(resharded), "--format", "dcp"],
                resharded,
                dcp_in,
                "dcp",
            ),
            (
                "ckptkit convert ckpt.dcp out.dcp --format dcp --workers 2 (a .distcp each)",
                [*ckptkit, str(src), str(resharded), "--format", "dcp", "--workers", "2"],
                resharded,
                dcp_in,
                "dcp",
            ),
        ]
        if not args.only_memory:
            cases = [
                ("cp -r ckpt.dcp", ["cp", "-r", str(src), str(copy)], copy, dcp_in, ""),
                ("cp -r ckpt.dcp && sync", ["sh", "-c", f"cp -r {src} {copy} && sync {copy}/*"], copy, dcp_in, ""),
                *cases,
            ]
        if single_file:
            cases += [
                ("cp single.pt", ["cp", str(flat), str(flat_copy)], flat_copy, pt_in, ""),
                (
                    "cp single.pt && sync",
                    ["sh", "-c", f"cp {flat} {flat_copy} && sync {flat_copy}"],
                    flat_copy,
                    pt_in,
                    "",
                ),
                (
                    "ckptkit convert single.pt out.pt (the same weights)",
                    [*ckptkit, str(flat), str(flat_out)],
                    flat_out,
                    pt_in,
                    "pt",
                ),
            ]
        if args.pair:
            cases = [c for c in cases if c[0].startswith("ckptkit convert") and "hf/" not in c[0]]
        if args.naive:
            cases.append(
                ("torch dcp_to_torch_save", [sys.executable, "-c", NAIVE, str(src), str(out)], out, dcp_in, "dcp")
            )
        times: dict[str, list[float]] = {c[0]: [] for c in cases}
        mems: dict[str, int] = dict.fromkeys(times, 0)
        for name, cmd, target, inputs, _ in rounds(cases, 1 if args.only_memory else args.runs):
            _clear(target)
            os.sync()  # no dirty pages left over from the previous command to slow this one
            for p in inputs:  # re-read untimed right before the run: a daemon here evicts idle page cache
                warm(p)
            t, m = run(cmd)
            if args.pair:
                print(f"run {len(times[name]) + 1}: {name}: {t:.3f} s", flush=True)
            times[name].append(t)
            mems[name] = max(mems[name], m)
            if args.folder_only:  # one output on disk at a time, beside the folder
                _clear(target)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = {"dcp": ("cp -r ckpt.dcp", "cp -r ckpt.dcp && sync"), "pt": ("cp single.pt", "cp single.pt && sync")}
        print(
            f"\nDCP folder: {size / 2**30:.2f} GiB in {len(dcp_in)} files ({size:,} bytes), saved "
            f"{'on a 2x2 mesh (each matrix sharded along both dims), 4 ranks' if args.mesh else 'by FSDP2 on 2 ranks'}; "
            f"{args.runs if not args.only_memory else 1} interleaved run(s), inputs re-read before each\n"
        )
        print("| command | min / median / max s | x cp | x cp && sync | peak RssAnon MiB |")
        print("|---|---|---:|---:|---:|")
        for name, _, _, _, kind in cases:
            ts = times[name]
            xs = [f"{med[name] / med[b]:.2f}" if kind in base and b in med else "" for b in base.get(kind, ("", ""))]
            print(f"| {name} | {spread(ts)} | {xs[0]} | {xs[1]} | {mems[name]} |")
        pt_name, dcp_name = "ckptkit convert single.pt out.pt (the same weights)", "ckptkit convert ckpt.dcp single.pt"
        if pt_name in times and dcp_name in times:
            print("\n" + paired(dcp_name, times[dcp_name], pt_name, times[pt_name]))
        subprocess.run(["df", "-h", str(scratch)], check=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
