"""Whole pickled modules (``torch.save(model, path)``) read as their ``state_dict()``, nothing run.

fixtures/pickled/ (fixtures/make_pickled_fixtures.py) holds module objects pickled by torch whose
classes cannot be imported here (``__main__.ToyCNN``, and a module deleted after saving), each
with the ``state_dict()`` torch gave for it beside it (``NAME.expected.pt``).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from safetensors.torch import load_file

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import UnsafeCheckpointError
from ckptkit.prefix import rewrite_prefixes
from tests.torchfree import limited_memory, run_torch_free

PICKLED = Path(__file__).resolve().parents[2] / "fixtures" / "pickled"
NAMES = ["plain", "dp", "ddp", "compiled", "compiled_ran", "dp_of_compiled", "gone"]
DESCRIPTIONS = {
    "plain": "ToyCNN",
    "dp": "DataParallel(ToyCNN)",
    "ddp": "DistributedDataParallel(ToyCNN)",
    "compiled": "OptimizedModule(ToyCNN)",
    "compiled_ran": "OptimizedModule(ToyCNN)",
    "dp_of_compiled": "DataParallel(OptimizedModule(ToyCNN))",
    "gone": "GoneNet",
}


# The saved classes, redefined here under other names: what a user loading the weights has.
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.bn = nn.BatchNorm1d(4)


class PlainCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.register_buffer("steps", torch.tensor(0))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 4), Block())


class PlainGone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.LayerNorm(3)
        self.register_buffer("scale", torch.zeros(1, dtype=torch.float64))


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def expected(name: str) -> OrderedDict[str, torch.Tensor]:
    return torch.load(PICKLED / f"{name}.expected.pt", weights_only=True)


def plain_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return rewrite_prefixes(state, to="single")  # module. and _orig_mod. removed, in any nesting


def assert_exactly(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    assert (list(got) if ordered else sorted(got)) == (list(want) if ordered else sorted(want))
    for k, v in want.items():
        assert type(got[k]) is torch.Tensor and got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_the_classes_cannot_be_imported_here() -> None:
    # Otherwise the tests below could pass through the classes; torch.load confirms it.
    with pytest.raises(AttributeError, match="ToyCNN"):
        torch.load(PICKLED / "plain.pt", weights_only=False)
    with pytest.raises(ModuleNotFoundError, match="ckptkit_gone_models"):
        torch.load(PICKLED / "gone.pt", weights_only=False)


def test_fixtures_hold_what_their_names_say() -> None:
    plain = expected("plain")
    assert "scratch" not in plain and "head.2.fc.bias" not in plain  # non-persistent buffer, None bias
    assert plain["bn.num_batches_tracked"].item() == 3 and plain["steps"].item() == 7
    assert list(expected("ddp")) == [f"module.{k}" for k in plain] == list(expected("dp"))
    assert list(expected("compiled")) == [f"_orig_mod.{k}" for k in plain]
    assert list(expected("dp_of_compiled")) == [f"module._orig_mod.{k}" for k in plain]
    assert all(
        torch.equal(v, plain[k.split("_orig_mod.")[-1].removeprefix("module.")])
        for k, v in expected("dp_of_compiled").items()
    )


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_read_checkpoint_gives_exactly_the_state_dict(name: str, trust: bool) -> None:
    got = ckptkit.read_checkpoint(PICKLED / f"{name}.pt", map_location="cpu", trust=trust)
    assert_exactly(got, expected(name))
    assert not any(v.requires_grad for v in got.values())  # state_dict() detaches


@pytest.mark.parametrize("name", NAMES)
def test_load_for_rank_into_a_plain_model(name: str) -> None:
    model = PlainGone() if name == "gone" else PlainCNN()
    ckptkit.load_for_rank(PICKLED / f"{name}.pt", model=model, map_location="cpu", verify=True)
    assert_exactly(model.state_dict(), plain_keys(expected(name)))
    if name != "gone":
        assert torch.equal(model.scratch, torch.zeros(3))  # not in the file: left as the model had it


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("name", NAMES)
def test_convert_cli(name: str, suffix: str, tmp_path: Path) -> None:
    out = tmp_path / f"model{suffix}"
    code, stdout, err = run("convert", PICKLED / f"{name}.pt", out)
    assert code == 0, err
    assert f"holds a pickled {DESCRIPTIONS[name]} module; its state_dict() was read without running the pickle" in err
    got = torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out)
    assert_exactly(got, plain_keys(expected(name)), ordered=suffix == ".pt")
    assert f"{len(got)} tensors" in stdout


@pytest.mark.parametrize("name", NAMES)
def test_inspect_cli(name: str) -> None:
    code, out, _ = run("inspect", PICKLED / f"{name}.pt", "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["pickled_module"] == DESCRIPTIONS[name] and not summary["loaded_with_torch"]
    want = expected(name)
    assert [(t["name"], t["shape"], t["dtype"]) for t in summary["tensors"]] == [
        (k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in want.items()
    ]
    code, text, _ = run("inspect", PICKLED / f"{name}.pt")
    assert (
        code == 0
        and f"A pickled {DESCRIPTIONS[name]} module: its state_dict() was read without running the pickle" in text
    )


@pytest.mark.parametrize("name", NAMES)
def test_verify_and_diff(name: str) -> None:
    code, out, _ = run("verify", PICKLED / f"{name}.pt")
    assert code == 0 and f"safe to load: a pickled {DESCRIPTIONS[name]} module" in out
    assert ckptkit.verify_checkpoint(PICKLED / f"{name}.pt").ok
    report = ckptkit.diff_checkpoints(PICKLED / f"{name}.pt", PICKLED / f"{name}.expected.pt")
    assert report.equal and report.compared == len(expected(name))


@pytest.mark.parametrize("protocol", [1, 2, 4])
def test_every_pickle_protocol_torch_writes(protocol: int, tmp_path: Path) -> None:
    # Protocol 1 builds objects with copyreg._reconstructor, 2 with NEWOBJ, 4 adds STACK_GLOBAL and frames.
    torch.manual_seed(protocol)
    model = nn.DataParallel(PlainCNN())
    torch.save(model, tmp_path / "m.pt", pickle_protocol=protocol)
    assert_exactly(ckptkit.read_checkpoint(tmp_path / "m.pt", map_location="cpu"), model.state_dict())


def test_tied_weights_stay_tied(tmp_path: Path) -> None:
    from fixtures.models import TiedLM

    model = TiedLM()
    torch.save(nn.DataParallel(model), tmp_path / "tied.pt")
    got = ckptkit.read_checkpoint(tmp_path / "tied.pt", map_location="cpu")
    assert_exactly(got, nn.DataParallel(model).state_dict())
    assert got["module.head.weight"].data_ptr() == got["module.embed.weight"].data_ptr()
    code, _, err = run("convert", tmp_path / "tied.pt", tmp_path / "tied.safetensors")
    assert code == 0 and "head.weight is embed.weight" in err  # stored once, re-tied on load
    plain = TiedLM()
    ckptkit.load_for_rank(tmp_path / "tied.safetensors", model=plain)
    assert_exactly(plain.state_dict(), model.state_dict())


def test_any_depth_and_no_cycle(tmp_path: Path) -> None:
    deep: nn.Module = nn.Linear(1, 1)
    for _ in range(1500):
        deep = nn.Sequential(deep)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # pickling the model recurses; torch's own state_dict() does too
    try:
        torch.save(deep, tmp_path / "deep.pt")
        want = deep.state_dict()
    finally:
        sys.setrecursionlimit(limit)
    assert_exactly(ckptkit.read_checkpoint(tmp_path / "deep.pt", map_location="cpu"), want)
    code, _, err = run("convert", tmp_path / "deep.pt", tmp_path / "deep.safetensors")
    assert code == 0, err
    assert_exactly(load_file(tmp_path / "deep.safetensors"), want, ordered=False)

    cyclic = nn.Sequential(nn.Linear(1, 1))
    cyclic.add_module("again", cyclic)  # state_dict() would never end
    torch.save(cyclic, tmp_path / "cyclic.pt")
    code, _, err = run("convert", tmp_path / "cyclic.pt", tmp_path / "out.pt")
    assert (
        code == 1
        and err.strip() == f"ckptkit: error: {tmp_path / 'cyclic.pt'}: pickled module: module again contains itself"
    )
    assert not (tmp_path / "out.pt").exists()


def test_a_storage_declared_larger_than_its_record_is_refused_before_torch_allocates_it(tmp_path: Path) -> None:
    data = (PICKLED / "plain.pt").read_bytes()
    first = re.search(rb"X\x03\x00\x00\x00cpuq.K\x03", data, flags=re.S)  # ('storage', ..., 'cpu', 3): scratch
    assert first is not None
    with zipfile.ZipFile(PICKLED / "plain.pt") as z:
        info = z.getinfo("plain/data.pkl")
        pickled = z.read(info)
    flipped = data[: first.end() - 1] + b"\xff" + data[first.end() :]  # 255 floats: 1020 bytes, record 12
    at = flipped.index(pickled[:16], info.header_offset)
    old_crc, new_crc = struct.pack("<I", info.CRC), struct.pack("<I", zlib.crc32(flipped[at : at + len(pickled)]))
    assert flipped.count(old_crc) == 2  # local header and central directory: the CRCs stay right
    bad = tmp_path / "bad.pt"
    bad.write_bytes(flipped.replace(old_crc, new_crc))
    checks = {c.name: c for c in ckptkit.verify_checkpoint(bad).checks}  # every CRC right, a size no record holds
    assert checks["CRC-32 of every record"].ok and not checks["tensors fit their storages"].ok
    with pytest.raises(
        ckptkit.errors.CheckpointFormatError,
        match=r"bad\.pt: fails verify \(tensors fit their storages: storage 0 declares 1020 bytes but its record holds 12\)",
    ):
        ckptkit.read_checkpoint(bad, trust=True)
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match=r"storage 0 declares 1020 bytes"):
        ckptkit.read_checkpoint(bad)


def test_a_module_saved_on_a_gpu_opens_on_the_cpu(tmp_path: Path) -> None:
    model = nn.DataParallel(PlainCNN())
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:0"):  # as a GPU run writes it
        torch.save(model, tmp_path / "gpu.pt")
    assert b"cuda:0" in (tmp_path / "gpu.pt").read_bytes()
    got = ckptkit.read_checkpoint(tmp_path / "gpu.pt", map_location=None if torch.cuda.is_available() else "cpu")
    assert_exactly({k: v.cpu() for k, v in got.items()}, model.state_dict())
    if not torch.cuda.is_available():
        assert {v.device.type for v in ckptkit.read_checkpoint(tmp_path / "gpu.pt").values()} == {"cpu"}


class _System:
    """Unpickling this runs ``touch MARKER`` through os.system: observable, and harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _hostile(tmp_path: Path) -> tuple[Path, Path, nn.Module]:
    marker = tmp_path / "PAYLOAD_RAN"
    model = PlainCNN()
    model.head[1].payload = _System(marker)  # a module attribute: pickled inside the module
    torch.save(model, tmp_path / "evil.pt")
    return tmp_path / "evil.pt", marker, model


def test_a_module_pickle_calling_os_system_is_refused_naming_it(tmp_path: Path) -> None:
    evil, marker, _ = _hostile(tmp_path)
    system = f"{os.system.__module__}.system"  # posix.system here
    with pytest.raises(UnsafeCheckpointError, match=rf"a pickled PlainCNN module.*{system}") as info:
        ckptkit.read_checkpoint(evil)
    assert info.value.globals == (system,)
    code, _, err = run("convert", evil, tmp_path / "out.pt")
    assert code == 1 and system in err and "Traceback" not in err
    code, out, _ = run("inspect", evil)
    assert code == 1 and f"a pickled PlainCNN module whose pickle calls or names {system}" in out
    code, out, _ = run("verify", evil)
    assert code == 1 and system in out
    assert run("diff", evil, evil)[0] == 2
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_trusting_a_hostile_module_pickle_still_runs_nothing(tmp_path: Path) -> None:
    evil, marker, model = _hostile(tmp_path)
    assert_exactly(ckptkit.read_checkpoint(evil, trust=True), model.state_dict())
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # what trusting it to torch does: the check above can fail
    assert marker.exists()


def test_a_hook_function_is_a_global_kept_as_a_value_and_refused(tmp_path: Path) -> None:
    model = PlainCNN()
    model.conv.register_forward_hook(print)  # pickled as a reference to builtins.print
    torch.save(model, tmp_path / "hooked.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.print") as info:
        ckptkit.read_checkpoint(tmp_path / "hooked.pt")
    assert info.value.globals == ("builtins.print",)
    assert_exactly(
        ckptkit.read_checkpoint(tmp_path / "hooked.pt", allow_globals=["builtins.print"]), model.state_dict()
    )


def test_torch_functions_kept_as_attributes_are_fine(tmp_path: Path) -> None:
    model = PlainCNN()
    model.act = torch.nn.functional.gelu  # as activation modules keep it: imported by torch.load, never called
    torch.save(model, tmp_path / "act.pt")
    assert_exactly(ckptkit.read_checkpoint(tmp_path / "act.pt"), model.state_dict())


def _add_marker_entry(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, local_metadata: dict) -> None:
    state[prefix + "from_hook"] = torch.tensor(1.0)


def test_state_dict_hooks_need_trust_and_then_run_in_torch(tmp_path: Path) -> None:
    model = PlainCNN()
    model._register_state_dict_hook(_add_marker_entry)  # changes state_dict(): not modelled
    torch.save(model, tmp_path / "hooked.pt")
    allow = [f"{__name__}._add_marker_entry"]
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"module \(PlainCNN\) has 1 _state_dict_hooks, which state_dict\(\) would run.*pass trust=True",
    ):
        ckptkit.read_checkpoint(tmp_path / "hooked.pt", allow_globals=allow)
    got = ckptkit.read_checkpoint(tmp_path / "hooked.pt", trust=True)
    assert list(got)[-1] == "from_hook"
    assert_exactly(got, model.state_dict())


@pytest.mark.parametrize("name", ["plain", "ddp", "compiled_ran"])
def test_what_failed_before_now_converts(name: str, tmp_path: Path) -> None:
    # Before: refused without --trust; with it "holds a ToyCNN, not a state dict", and for DDP
    # "Default process group has not been initialized" told as a damaged file. A compiled model
    # that had run was refused for torch._tensor._rebuild_from_type_v2 (its buffers' pickling),
    # and with --trust failed to import its class. A trusted file's note said "loaded with
    # torch" beside "read without running the pickle".
    for extra in ([], ["--trust"]):
        out = tmp_path / f"{name}{len(extra)}.pt"
        code, _, err = run("convert", PICKLED / f"{name}.pt", out, *extra)
        assert code == 0, err
        assert "damaged" not in err and "not a state dict" not in err
        assert (
            f"holds a pickled {DESCRIPTIONS[name]} module; its state_dict() was read without running the pickle" in err
        )
        assert "loaded with torch" not in err
        assert_exactly(torch.load(out, weights_only=True), plain_keys(expected(name)))


@pytest.mark.parametrize("name", ["plain", "dp", "ddp"])
def test_trusted_module_whose_classes_do_import(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The training script importable as the pickle names its classes (__main__.ToyCNN). Before,
    # --trust gave "holds a ToyCNN, not a state dict", and for DDP "Default process group has not
    # been initialized", told as a damaged file. Now the same inert walk: nothing imported or run.
    monkeypatch.setattr(sys.modules["__main__"], "ToyCNN", PlainCNN, raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "Block", Block, raising=False)
    code, _, err = run("convert", PICKLED / f"{name}.pt", tmp_path / "out.pt", "--trust")
    assert code == 0, err
    assert_exactly(torch.load(tmp_path / "out.pt", weights_only=True), plain_keys(expected(name)))
    model = PlainCNN()
    ckptkit.load_for_rank(PICKLED / f"{name}.pt", model=model, map_location="cpu", trust=True)
    assert_exactly(model.state_dict(), plain_keys(expected(name)))


def test_fast_path_never_imports_torch(tmp_path: Path) -> None:
    proc, imported = run_torch_free(
        ["convert", PICKLED / "ddp.pt", tmp_path / "a.safetensors"],
        ["convert", PICKLED / "compiled.pt", tmp_path / "b.pt"],
        ["inspect", PICKLED / "gone.pt"],
        ["verify", PICKLED / "dp.pt"],
    )
    assert proc.returncode == 0, proc.stderr
    assert not imported


@pytest.mark.parametrize("command", ["inspect", "convert", "read"])
def test_a_module_shared_along_2_to_the_40_paths_is_refused_not_walked(tmp_path: Path, command: str) -> None:
    """10 kB of pickle: one Linear reachable as .a and .b at each of 40 levels (state_dict() would
    name it 2**40 times)."""
    m: nn.Module = nn.Linear(2, 2)
    for _ in range(40):
        parent = nn.Module()
        parent.a = m
        parent.b = m
        m = parent
    torch.save(m, tmp_path / "dag.pt")
    args = {
        "inspect": ["-m", "ckptkit.cli", "inspect", str(tmp_path / "dag.pt")],
        "convert": ["-m", "ckptkit.cli", "convert", str(tmp_path / "dag.pt"), str(tmp_path / "o.pt")],
        "read": ["-c", f"import ckptkit; ckptkit.read_checkpoint({str(tmp_path / 'dag.pt')!r})"],
    }[command]
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, preexec_fn=limited_memory
    )
    assert proc.returncode == 1
    assert "its modules would be visited more than 200,000 times (a submodule shared along many paths)" in proc.stderr
    assert not (tmp_path / "o.pt").exists()


def test_a_quantized_module_is_not_read_as_its_parameters(tmp_path: Path) -> None:
    """Its packed weights are saved by its own _save_to_state_dict: the inert walk would miss them."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notes
        q = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 4)), {nn.Linear}, dtype=torch.qint8)
        torch.save(q, tmp_path / "q.pt")
    result = CliRunner().invoke(
        main,
        ["convert", str(tmp_path / "q.pt"), str(tmp_path / "o.pt"), "--allow-global", "torch._utils._rebuild_qtensor"],
    )
    assert result.exit_code == 1 and "is a quantized module, whose state_dict() is its own code" in result.output
    assert not (tmp_path / "o.pt").exists()
