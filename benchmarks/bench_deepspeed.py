"""Speed and memory of ``ckptkit convert`` on a DeepSpeed ZeRO-3 folder, against ``cp -r`` of it.

    python benchmarks/bench_deepspeed.py --check                  # the synthetic folder is faithful
    python benchmarks/bench_deepspeed.py --gib 1 --runs 3         # time, interleaved with cp -r
    python benchmarks/bench_deepspeed.py --gib 4 --only-memory    # peak private memory at 4 GiB

Real ZeRO-3 training of a 4 GiB model does not fit a small CPU machine, so the folder is written
here in DeepSpeed 0.19.8's exact layout (fixtures/DEEPSPEED_LAYOUT.md), for 2 ranks of a bf16 run
of bench_convert.py's GPT-like model (``--gib``: its fp32 weights): per rank a model-state file of
0-element bf16 placeholders with ``param_shapes`` (two groups, decay and no decay) and the rest,
and an optim file whose ``fp32_flat_groups`` hold the rank's chunk of every parameter as
DeepSpeed partitions them, pickled as DeepSpeed pickles them (``requires_grad`` and a ``ds_id``
attribute), beside Adam's ``exp_avg``/``exp_avg_sq`` and deepspeed's own ``LossScaler`` and
``ZeroStageEnum`` objects. ``--check`` builds a small one and requires DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` to equal ``ckptkit convert``'s output exactly (keys,
order, dtypes, values), and the pickles to name the globals the real fixtures name.

Each run does ``cp -r``, ``cp -r && sync`` (a durable copy, as ckptkit fsyncs what it writes),
the convert to one file and to 200MB shards, in turn, the order reversed every other round; every
input is re-read untimed right before its run. The table gives min / median / max wall seconds,
ratios to the copies' medians of the same run, and peak ``RssAnon`` (private memory).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # deepspeed's objects are pickled from deepspeed itself
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_convert import add_common_args, compile_ckptkit, gpt_dims, rounds, run, spread, warm  # noqa: E402

TAG, WORLD = "global_step3", 2
NAIVE = """
import sys
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2], safe_serialization=False, max_shard_size="100GB")
"""


def gpt_params(gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """Name and shape of every parameter of bench_convert.py's GPT-like model, in state_dict order."""
    d, vocab, ff, layers = gpt_dims(gib)
    block = [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("qkv.weight", (3 * d, d)),
        ("qkv.bias", (3 * d,)),
        ("proj.weight", (d, d)),
        ("proj.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("up.weight", (ff, d)),
        ("up.bias", (ff,)),
        ("down.weight", (d, ff)),
        ("down.bias", (d,)),
    ]
    names = [("embed.weight", (vocab, d))] + [(f"layers.{i}.{n}", s) for i in range(layers) for n, s in block]
    return names + [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (vocab, d))]


def _values(index: int, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(index))  # the fp32 master, flat


def make_zero3(
    folder: Path, gib: float, *, optim_states: bool = True, extra: tuple[tuple[str, tuple[int, ...]], ...] = ()
) -> None:
    """Write a ZeRO-3 folder (``latest`` and ``global_step3/``) of 2 ranks, bf16 mode, as DeepSpeed 0.19.8 does.

    ``extra``: more parameters (odd sizes: a rank's chunk then ends in padding).
    """
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    params = gpt_params(gib) + list(extra)
    # Two groups, as trainers build them: matrices decay, biases and norms do not.
    groups = [
        [(i, n, s) for i, (n, s) in enumerate(params) if len(s) == 2],
        [(i, n, s) for i, (n, s) in enumerate(params) if len(s) == 1],
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
    }
    step = folder / TAG
    step.mkdir(parents=True)
    (folder / "latest").write_text(TAG)  # no newline, as DeepSpeed writes it
    for rank in range(WORLD):
        module = OrderedDict(
            (n, torch.empty(0, dtype=torch.bfloat16)) for n, _ in params
        )  # each its own 0-byte storage
        torch.save(
            {
                "module": module,
                "buffer_names": [],
                "optimizer": None,
                "param_shapes": [OrderedDict((n, torch.Size(s)) for _, n, s in g) for g in groups],
                "frozen_param_shapes": OrderedDict(),
                "shared_params": {},
                "frozen_param_fragments": OrderedDict(),
                "lr_scheduler": None,
                "data_sampler": None,
                "random_ltd": None,
                "skipped_steps": 0,
                "global_steps": 3,
                "global_samples": 12,
                "dp_world_size": WORLD,
                "mp_world_size": 1,
                "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                "ds_config": config,
                "ds_version": "0.19.8",
            },
            step / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
        )
        flats = []
        for g, group in enumerate(groups):
            # Each parameter is partitioned on its own: ceil(numel / world) per rank, the padding at
            # the end of the last rank's chunk; a rank's flat group is its chunks back to back.
            sizes = [math.ceil(math.prod(s) / WORLD) for _, _, s in group]
            flat = torch.zeros(sum(sizes))
            at = 0
            for (i, _, s), part in zip(group, sizes, strict=True):
                chunk = _values(i, s)[rank * part : (rank + 1) * part]
                flat[at : at + chunk.numel()] = chunk
                at += part
            flat.requires_grad_(True)
            flat.ds_id = f"{g + 1}_{len(group) + g}"  # type: ignore[attr-defined]  # a Python attribute: pickled via _rebuild_from_type_v2
            flats.append(flat)
        state = {
            g: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.zeros_like(f.detach()) if optim_states else torch.zeros(0),
                "exp_avg_sq": torch.zeros_like(f.detach()) if optim_states else torch.zeros(0),
            }
            for g, f in enumerate(flats)
        }
        hyper = {
            "lr": 1e-4,
            "betas": (0.9, 0.999),
            "eps": 1e-08,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }
        param_groups = [{"weight_decay": 0.01 if g == 0 else 0.0, **hyper, "params": [g]} for g in range(len(flats))]
        osd = {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": WORLD,
            "optimizer_state_dict": {"state": state, "param_groups": param_groups},
            "fp32_flat_groups": flats,
        }
        torch.save(
            {"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
            step / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
        del flats, state, osd


def check(scratch: Path) -> None:
    """DeepSpeed's own reconstruction of a small synthetic folder equals ckptkit's output exactly."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder, out = scratch / "small", scratch / "small.pt"
    make_zero3(folder, 0.02, extra=(("odd.weight", (7, 13)), ("odd.bias", (9,))))  # padded chunks too
    real = Path(__file__).resolve().parent.parent / "fixtures/deepspeed/bf16/zero3" / TAG
    for kind in ("model_states", "optim_states"):  # the same globals as DeepSpeed's own files
        ours = {
            g
            for p in (folder / TAG).glob(f"*{kind}.pt")
            for g in torch.serialization.get_unsafe_globals_in_checkpoint(p)
        }
        theirs = {g for p in real.glob(f"*{kind}.pt") for g in torch.serialization.get_unsafe_globals_in_checkpoint(p)}
        assert ours == theirs, (kind, ours, theirs)
    expected = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "convert", str(folder), str(out)], check=True, capture_output=True
    )
    got = torch.load(out, weights_only=True)
    assert list(got) == list(expected), "keys or their order differ"
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    n = sum(v.numel() for v in expected.values())
    print(
        f"--check: deepspeed's get_fp32_state_dict_from_zero_checkpoint == ckptkit convert, exactly: "
        f"{len(expected)} tensors, {n:,} fp32 values, keys in the same order; pickled globals as in fixtures/deepspeed"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, runs=3, only_memory="only ckptkit's converts of the folder, once (for big --gib)")
    ap.add_argument("--naive", action="store_true", help="also DeepSpeed's zero_to_fp32 (whole state dict in memory)")
    ap.add_argument("--check", action="store_true", help="only the faithfulness check, at a small size")
    args = ap.parse_args()
    compile_ckptkit()
    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptkit-bench-ds-"))
    try:
        if args.check:
            check(scratch)
            return 0
        src = scratch / "zero3"
        make_zero3(src, args.gib)
        files = sorted((src / TAG).iterdir())
        size = sum(p.stat().st_size for p in files)
        weights = sum(math.prod(s) for _, s in gpt_params(args.gib)) * 4
        copy, out, shards = scratch / "copy", scratch / "single.pt", scratch / "hf"
        ckptkit = [sys.executable, "-m", "ckptkit.cli", "convert"]
        # (name, command, output to clear, baseline rows)
        cases = [
            ("ckptkit convert zero3/ single.pt", [*ckptkit, str(src), str(out)], out, True),
            (
                "ckptkit convert zero3/ hf/ (200MB shards)",
                [*ckptkit, str(src), f"{shards}/", "--max-shard-size", "200MB"],
                shards,
                True,
            ),
        ]
        if not args.only_memory:
            cases = [
                ("cp -r zero3", ["cp", "-r", str(src), str(copy)], copy, False),
                ("cp -r zero3 && sync", ["sh", "-c", f"cp -r {src} {copy} && sync {copy}/{TAG}/*"], copy, False),
                *cases,
            ]
        if args.naive:
            cases.append(
                ("deepspeed zero_to_fp32 (--naive)", [sys.executable, "-c", NAIVE, str(src), str(out)], out, True)
            )
        times: dict[str, list[float]] = {c[0]: [] for c in cases}
        mems: dict[str, int] = dict.fromkeys(times, 0)
        for name, cmd, target, _ in rounds(cases, 1 if args.only_memory else args.runs):
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            os.sync()  # no dirty pages left over from the previous command to slow this one
            for p in files:  # re-read untimed right before the run: idle page cache gets evicted here
                warm(p)
            t, m = run(cmd)
            times[name].append(t)
            mems[name] = max(mems[name], m)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = ("cp -r zero3", "cp -r zero3 && sync")
        print(
            f"\nZeRO-3 folder (synthetic, DeepSpeed 0.19.8 layout, bf16 run, {WORLD} ranks): {weights / 2**30:.2f} GiB of fp32 "
            f"weights, {size / 2**30:.2f} GiB in {len(files)} files with Adam states ({size:,} bytes); "
            f"{1 if args.only_memory else args.runs} interleaved run(s), inputs re-read before each\n"
        )
        print("| command | min / median / max s | x cp -r | x cp -r && sync | peak RssAnon MiB |")
        print("|---|---|---:|---:|---:|")
        for name, _, _, vs_cp in cases:
            xs = [f"{med[name] / med[b]:.2f}" if vs_cp and b in med else "" for b in base]
            print(f"| {name} | {spread(times[name])} | {xs[0]} | {xs[1]} | {mems[name]} |")
        subprocess.run(["df", "-h", str(scratch)], check=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
