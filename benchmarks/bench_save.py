"""Save and load speed against the peers, on the same state dict, in one run.

    python benchmarks/bench_save.py                          # 1 GiB, median of 5, --dir /dev/shm
    python benchmarks/bench_save.py --dir /tmp/bench --runs 5  # on disk
    python benchmarks/bench_save.py --training               # model + AdamW state (3 GiB with 1 GiB of weights)

Peers: ``torch.save``/``torch.load`` (mmap), ``safetensors.torch.save_file``/``load_file``,
``torch.distributed.checkpoint`` (single process, 2 writer threads), and, when installed,
Accelerate's ``save_state``/``load_state`` and Lightning Fabric's ``save``/``load``. Every save is
followed by an fsync of what it wrote (ckptkit's own saves fsync already; the table says which
peers do it themselves), so durable saves are compared with durable saves. Every load reads a
file whose pages were read just before (untimed: a daemon here evicts idle page cache within
seconds) and ends with the weights in a model of the same shapes. The runs of the compared
commands are interleaved; the table shows min/median/max and ckptkit's ratio to each median.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def make_model(gib: float) -> torch.nn.Module:
    """A model whose fp32 weights take about ``gib`` GiB, as 32 MiB tensors plus small ones."""
    g = torch.Generator().manual_seed(0)
    n = max(1, round(gib * 2**30 / (32 << 20)))
    model = torch.nn.Module()
    for i in range(n):
        layer = torch.nn.Linear(2048, 4096)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(4096, 2048, generator=g))
        model.add_module(f"layer{i}", layer)
    return model


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or the file itself), then its folder."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path if path.is_dir() else path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all(path: Path) -> None:
    """Read every file once, untimed, so the timed load finds warm pages."""
    for p in [path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file()):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def peers(
    model: torch.nn.Module, opt: Any, out: Path, training: bool
) -> dict[str, tuple[Callable[[], Path], Callable[[Path], None], bool]]:
    """name -> (save, load, fsyncs itself). ``save`` returns what it wrote."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    import ckptkit

    sd = model.state_dict()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()} if training else sd
    found: dict[str, tuple[Callable[[], Path], Callable[[Path], None], bool]] = {}

    def ck_save() -> Path:
        p = out / "ckptkit.pt"
        if training:
            ckptkit.save_training_state(p, model=model, optimizer=opt)
        else:
            ckptkit.save_on_master(sd, p)
        return p

    def ck_load(p: Path) -> None:
        if training:
            ckptkit.load_training_state(p, model=model, optimizer=opt, restore_rng=False)
        else:
            ckptkit.load_for_rank(p, model=model)

    found["ckptkit"] = (ck_save, ck_load, True)
    if not training:  # the same file, loaded after every CRC is checked
        found["ckptkit, load verify=True"] = (
            ck_save,
            lambda p: ckptkit.load_for_rank(p, model=model, verify=True),
            True,
        )

    def torch_save() -> Path:
        torch.save(state, out / "torch.pt")
        return out / "torch.pt"

    def torch_load(p: Path) -> None:
        got = torch.load(p, mmap=True, weights_only=True)
        model.load_state_dict(got["model"] if training else got)
        if training:
            opt.load_state_dict(got["optimizer"])

    found["torch.save / torch.load(mmap)"] = (torch_save, torch_load, False)
    if not training:

        def st_save() -> Path:
            save_file(sd, out / "model.safetensors")
            return out / "model.safetensors"

        found["safetensors save_file / load_file"] = (st_save, lambda p: model.load_state_dict(load_file(p)), False)

    def dcp_save() -> Path:
        d = out / "dcp"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d, thread_count=2), no_dist=True)
        return d

    def dcp_load(p: Path) -> None:
        target = {"model": model.state_dict(), "optimizer": opt.state_dict()} if training else model.state_dict()
        dcp.load(target, storage_reader=dcp.FileSystemReader(p), no_dist=True)

    found["dcp.save (2 threads) / dcp.load"] = (dcp_save, dcp_load, True)  # FileSystemWriter(sync_files=True)
    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        prepared = acc.prepare(model, opt) if training else acc.prepare(model)

        def acc_save() -> Path:
            acc.save_state(out / "accelerate")
            return out / "accelerate"

        found["accelerate save_state / load_state"] = (acc_save, lambda p: acc.load_state(p), False)
        del prepared
    except ImportError:
        pass
    try:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        fabric_state = {"model": model, "optimizer": opt} if training else {"model": model}

        def fabric_save() -> Path:
            fabric.save(out / "fabric.ckpt", fabric_state)
            return out / "fabric.ckpt"

        found["lightning fabric save / load"] = (fabric_save, lambda p: fabric.load(p, fabric_state), False)
    except ImportError:
        pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--training", action="store_true", help="model + AdamW state instead of a state dict")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = make_model(args.gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.training:  # AdamW's state exists after a step: two more tensors per weight
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    moments = sum(
        t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )
    nbytes = weights + moments  # the tensor bytes each save writes
    out = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench-save-"))
    try:
        found = peers(model, opt, out, args.training)
        saves: dict[str, list[float]] = {k: [] for k in found}
        loads: dict[str, list[float]] = {k: [] for k in found}
        for _ in range(args.runs):  # interleaved: every command once per round
            for name, (save, _load, self_sync) in found.items():
                if name.endswith("verify=True"):
                    continue
                start = time.perf_counter()
                written = save()
                if not self_sync:
                    fsync_tree(written)
                saves[name].append(time.perf_counter() - start)
                for lname in [n for n in found if n == name or (name == "ckptkit" and n.endswith("verify=True"))]:
                    read_all(written)
                    start = time.perf_counter()
                    found[lname][1](written)
                    loads[lname].append(time.perf_counter() - start)
                clear(written)
        print(
            f"{'training state (model + AdamW)' if args.training else 'state dict'}: {weights / 2**30:.2f} GiB of weights"
            f" in {len(model.state_dict())} tensors, {nbytes / 2**30:.2f} GiB of tensors in all, {args.runs} interleaved"
            f" runs, in {args.dir}"
        )
        ck_save, ck_load = statistics.median(saves["ckptkit"]), statistics.median(loads["ckptkit"])
        print(
            "| peer | save s (min / median / max) | save GB/s | fsyncs itself | ckptkit save x | load s (min / median / max) | ckptkit load x |"
        )
        print("|---|---|---:|---|---:|---|---:|")
        for name, (_, _, self_sync) in found.items():
            s, lo = saves[name], loads[name]
            fmt = lambda xs: f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}" if xs else "-"  # noqa: E731
            gbps = nbytes / 1e9 / statistics.median(s) if s else 0
            sx = f"{ck_save / statistics.median(s):.2f}" if s else ""
            lx = f"{ck_load / statistics.median(lo):.2f}" if lo else ""
            print(
                f"| {name} | {fmt(s)} | {gbps:.2f} | {'yes' if self_sync else 'no (added)'} | {sx} | {fmt(lo)} | {lx} |"
            )
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
