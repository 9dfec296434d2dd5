"""Checkpoints whose pickles try to run code. Each payload, if it ever runs, creates a marker
file, so "the payload never ran" is an observation, not an assumption."""

from __future__ import annotations

import builtins
import copyreg
import functools
import importlib
import os
import pickle
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.torchcompat import SAVE_ALONE


class Reduce:
    """Pickles as ``func(*args)``; nests (args may be Reduce objects) and may itself be called."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args

    def __call__(self, *args: Any) -> Any:  # only so pickle accepts it as the callable of a REDUCE
        raise AssertionError("never called while pickling")


def payloads(marker: Path) -> dict[str, Any]:
    """name -> an object whose unpickling creates ``marker``."""
    import torch

    m = str(marker)
    os_module = Reduce(importlib.import_module, "os")
    found = {
        "os.system": Reduce(os.system, f"touch {m}"),
        "builtins.eval": Reduce(builtins.eval, f"open({m!r}, 'w').close()"),
        "builtins.exec": Reduce(builtins.exec, f"open({m!r}, 'w').close()"),
        "subprocess.Popen": Reduce(subprocess.Popen, ["touch", m]),
        "importlib + getattr chain": Reduce(Reduce(getattr, os_module, "system"), f"touch {m}"),
        "nested __reduce__ in a list": [torch.ones(1), {"deep": [Reduce(os.system, f"touch {m}")]}],
        "functools.partial": Reduce(Reduce(functools.partial, os.system, f"touch {m}")),
        "torch.save (a torch.* function)": Reduce(torch.save, {}, m),
        "torch._C internal": Reduce(torch._C._log_api_usage_once, "ckptkit-test"),
        "_rebuild_tensor_v2 with a payload storage": Reduce(
            torch._utils._rebuild_tensor_v2, Reduce(os.system, f"touch {m}"), 0, (1,), (1,), False, {}
        ),
        "_rebuild_from_type_v2 calling os.system": Reduce(
            torch._tensor._rebuild_from_type_v2, os.system, torch.Tensor, (f"touch {m}",), {}
        ),
        "copyreg._reconstructor": Reduce(copyreg._reconstructor, Reduce, object, None),
    }
    try:
        pickle.dumps(torch._C._log_api_usage_once)
    except TypeError:  # torch 2.6's torch._C builtins do not pickle: no file can name one there
        del found["torch._C internal"]
    return found


def files(folder: Path, marker: Path) -> Iterator[tuple[str, Path]]:
    """``(description, path)``: each payload as a torch zip file, some also legacy and DCP."""
    import torch
    import torch.distributed.checkpoint as dcp

    for i, (name, payload) in enumerate(payloads(marker).items()):
        path = folder / f"payload{i:02d}.pt"
        torch.save({"model": {"w": torch.ones(2)}, "x": payload}, path)
        yield f"{name} (torch zip)", path
        if i < 4:
            legacy = folder / f"payload{i:02d}_legacy.pt"
            torch.save({"model": {"w": torch.ones(2)}, "x": payload}, legacy, _use_new_zipfile_serialization=False)
            yield f"{name} (legacy format)", legacy
    meta_dir = folder / "dcp_metadata_payload"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(meta_dir), **SAVE_ALONE)
    (meta_dir / ".metadata").write_bytes(pickle.dumps(Reduce(os.system, f"touch {marker}"), protocol=2))
    yield "os.system in DCP .metadata", meta_dir
    entry_dir = folder / "dcp_entry_payload"
    dcp.save(
        {"w": torch.ones(2), "x": Reduce(os.system, f"touch {marker}")}, checkpoint_id=str(entry_dir), **SAVE_ALONE
    )
    yield "os.system in a DCP non-tensor entry", entry_dir


def readers(out: Path) -> dict[str, Callable[[Path], Any]]:
    """Every way ckptkit reads a file, from the library and the CLI."""
    import ckptkit
    from fixtures.models import TinyNet

    def cli(*args: str) -> Callable[[Path], Any]:
        def run(p: Path) -> Any:
            from click.testing import CliRunner

            from ckptkit.cli import main

            result = CliRunner().invoke(main, [a.replace("{p}", str(p)) for a in args])
            if result.exit_code != (2 if args[0] == "diff" else 1):  # diff: 2 for trouble, as GNU diff
                raise AssertionError(f"exit {result.exit_code}: {result.output[-300:]}")

        return run

    return {
        "read_checkpoint": lambda p: ckptkit.read_checkpoint(p),
        "load_for_rank": lambda p: ckptkit.load_for_rank(p, model=TinyNet(), key="model"),
        "load_training_state": lambda p: ckptkit.load_training_state(p, model=TinyNet()),
        "inspect_checkpoint": lambda p: ckptkit.inspect_checkpoint(p),
        "verify_checkpoint": lambda p: ckptkit.verify_checkpoint(p),
        "convert_checkpoint": lambda p: ckptkit.convert_checkpoint(p, out, force=True),
        "diff_checkpoints": lambda p: ckptkit.diff_checkpoints(p, p),
        "cli convert": cli("convert", "{p}", str(out), "--force"),
        "cli inspect": cli("inspect", "{p}"),
        "cli verify": cli("verify", "{p}"),
        "cli diff": cli("diff", "{p}", "{p}"),
    }
