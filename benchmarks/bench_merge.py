"""``ckptkit convert --merge-adapter`` against a plain convert of the same base, and against the
few lines users write by hand (load the whole base, add each delta, save).

    python benchmarks/bench_merge.py                    # ~2 GiB fp32 base, LoRA r=16, 3 runs
    python benchmarks/bench_merge.py --gib 4 --runs 1

The base is the GPT-like DDP state dict of ``bench_convert.py`` (``module.`` keys, fp32) as one
safetensors file; the adapter is a PEFT-layout LoRA (``adapter_model.safetensors`` and
``adapter_config.json``) on every layer's ``attn.qkv``, ``attn.proj``, ``mlp.up`` and ``mlp.down``.
Every command is a whole process, interleaved, its input re-read untimed before each run, and
every merged output is checked against the hand-written merge's, tensor for tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_convert import add_common_args, compile_ckptkit, make_checkpoint, rounds, run, spread, warm

TARGETS = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
NAIVE = """
import json, sys, torch
from safetensors.torch import load_file, save_file
sd = {k.removeprefix("module."): v for k, v in load_file(sys.argv[1]).items()}
lora = load_file(sys.argv[2] + "/adapter_model.safetensors")
config = json.load(open(sys.argv[2] + "/adapter_config.json"))
scaling = config["lora_alpha"] / config["r"]
for k in [k for k in lora if k.endswith(".lora_A.weight")]:
    module = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
    sd[module + ".weight"] += (lora[k.replace("lora_A", "lora_B")] @ lora[k]) * scaling
save_file(sd, sys.argv[3])
"""


def make_adapter(folder: Path, base: Path, r: int) -> None:
    """A PEFT-layout LoRA on every layer's TARGETS of ``base``, its lora_B away from zero."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(1)
    lora: dict[str, torch.Tensor] = {}
    with safe_open(base, "pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            name = k.removeprefix("module.").removesuffix(".weight")
            if k.endswith(".weight") and name.endswith(TARGETS):
                out, inp = f.get_slice(k).get_shape()
                lora[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, inp, generator=g) / inp**0.5
                lora[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out, r, generator=g) / 100
    save_file(lora, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": [t.split(".")[1] for t in TARGETS]}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, runs=3, only_memory="only the ckptkit merge (for big --gib)")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    compile_ckptkit()
    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptkit-bench-"))
    try:
        pt, st = make_checkpoint(scratch, args.gib)
        pt.unlink()
        adapter = scratch / "lora"
        make_adapter(adapter, st, args.rank)
        size = st.stat().st_size
        ck = [sys.executable, "-m", "ckptkit.cli", "convert", str(st)]
        o = scratch / "out"
        cases = [
            ("cp base.safetensors && sync", ["sh", "-c", f"cp {st} {o}-cp && sync {o}-cp"], f"{o}-cp"),
            ("ckptkit convert base single.safetensors", [*ck, f"{o}-plain.safetensors"], f"{o}-plain.safetensors"),
            (
                "ckptkit convert base merged.safetensors --merge-adapter lora/",
                [*ck, f"{o}-merged.safetensors", "--merge-adapter", str(adapter)],
                f"{o}-merged.safetensors",
            ),
            (
                "naive: load_file, W += s·B@A, save_file",
                [sys.executable, "-c", NAIVE, str(st), str(adapter), f"{o}-naive.safetensors"],
                f"{o}-naive.safetensors",
            ),
        ]
        if args.only_memory:
            cases = cases[2:3]
        times: dict[str, list[float]] = {c[0]: [] for c in cases}
        mems = dict.fromkeys(times, 0)
        for name, cmd, out in rounds(cases, args.runs):
            Path(out).unlink(missing_ok=True)
            os.sync()
            warm(st)
            t, m = run(cmd)
            times[name].append(t)
            mems[name] = max(mems[name], m)
        same = "not compared (--only-memory)"
        if not args.only_memory:
            same = _compare(Path(f"{o}-merged.safetensors"), Path(f"{o}-naive.safetensors"))
        med = {n: statistics.median(ts) for n, ts in times.items()}
        plain = "ckptkit convert base single.safetensors"
        print(
            f"\nbase: {size / 2**30:.2f} GiB ({size:,} bytes) of fp32 in {scratch.parent}; LoRA r={args.rank} on "
            f"{', '.join(TARGETS)} of every layer; {args.runs} interleaved run(s), the base re-read before each; "
            f"merged output vs the hand-written merge: {same}\n"
        )
        print("| command | min / median / max s | x plain convert | peak RssAnon MiB |")
        print("|---|---|---:|---:|")
        for name in times:
            x = f"{med[name] / med[plain]:.2f}" if plain in med else ""
            print(f"| `{name}` | {spread(times[name])} | {x} | {mems[name]} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _compare(a: Path, b: Path) -> str:
    """Whether two merged outputs hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return "DIFFERENT names"
        differ = [k for k in fa.keys() if not torch.equal(fa.get_tensor(k), fb.get_tensor(k))]  # noqa: SIM118
    return f"{len(differ)} tensor(s) DIFFER ({', '.join(differ[:3])})" if differ else "identical"


if __name__ == "__main__":
    sys.exit(main())
