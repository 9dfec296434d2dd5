"""A differential oracle for ``ckptkit convert`` (issue 24): generated state dicts, written by the
peer libraries in every source format, converted with every renaming option and output format,
and read back by the peer's own reader. The answer is plain torch: the generated tensors, renamed
by the documented rules written out below in a few lines. Every output must pass ``verify`` and
equal it exactly; where a command fails, it must fail in one line and leave nothing behind.

Hypothesis runs derandomized (the same examples every run), so CI is repeatable.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.cli import main
from ckptkit.io.atomic import TMP_SUFFIX
from tests.torchcompat import LOAD_ALONE, SAVE_ALONE

WRAPPERS = ("module", "_orig_mod")
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
SHAPES = [(), (0,), (3,), (2, 3), (0, 4), (4, 1, 2)]
ORACLE = settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=g,
    )
    if str(dtype).startswith("torch.float8"):  # below 0x70: no NaN or inf in either float8 layout
        t = (raw % 0x70).view(dtype)
    elif dtype.is_floating_point or dtype.is_complex:  # any bits but NaN, whose payload a peer may change
        t = raw.view(dtype)
        t = torch.where(torch.isnan(t), torch.zeros((), dtype=dtype), t)
    elif dtype == torch.bool:
        t = (raw % 2).bool()
    else:
        t = raw.view(dtype)
    return t[: torch.Size(shape).numel()].reshape(shape).clone()


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """1-4 tensors under one wrapper nesting, of any dtype and shape, some non-contiguous, maybe a
    tied name (the same tensor object under a second name) and torch's ``_metadata``."""
    wrapper = draw(st.sampled_from(["", "module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."]))
    inner = draw(st.sampled_from(["", "_orig_mod."]))  # a wrapped submodule, below the root
    names = draw(
        st.lists(
            st.sampled_from(["enc.w", "enc.b", "dec.w", "head.weight", "norm.bias", "step"]),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        dtype, shape = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))
        t = _values(dtype, shape, seed=i + 17 * len(names))
        if len(shape) == 2 and draw(st.booleans()):
            t = _values(dtype, shape[::-1], seed=i).t()  # a transposed view: not contiguous
        head, _, leaf = name.rpartition(".")
        out[f"{wrapper}{head}.{inner}{leaf}" if head else f"{wrapper}{leaf}"] = t
    if draw(st.booleans()):  # a tied weight, as a model's tied embedding and head save it
        out[f"{wrapper}tied.weight"] = next(iter(out.values()))
    if draw(st.booleans()):
        out = OrderedDict(out)
        out._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]  # as state_dict() sets it
    return out


def canonical(key: str) -> str:
    """The documented rename of ``convert`` (--to single): every wrapper segment dropped."""
    return ".".join(p for p in key.split(".") if p not in WRAPPERS)


# -- the sources, each written by its own library -----------------------------------------------


def _contiguous(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What safetensors-based writers take: contiguous tensors, none shared (ties are HF's own
    business: they drop them on save, and the model re-ties them on load)."""
    return {k: v.contiguous().clone() for k, v in sd.items()}


def write_torch(sd: dict[str, torch.Tensor], folder: Path) -> Path:
    torch.save(sd, folder / "src.pt")
    return folder / "src.pt"


def write_safetensors(sd: dict[str, torch.Tensor], folder: Path) -> Path:
    from safetensors.torch import save_file

    save_file(_contiguous(sd), folder / "src.safetensors")
    return folder / "src.safetensors"


def write_hf(sd: dict[str, torch.Tensor], folder: Path) -> Path:
    from huggingface_hub import save_torch_state_dict

    (folder / "hf").mkdir()
    save_torch_state_dict(_contiguous(sd), folder / "hf", max_shard_size=64)  # several shards
    return folder / "hf"


def write_dcp(sd: dict[str, torch.Tensor], folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(_contiguous(sd), checkpoint_id=folder / "src.dcp", **SAVE_ALONE)
    return folder / "src.dcp"


def write_hf_bin(sd: dict[str, torch.Tensor], folder: Path) -> Path:
    from huggingface_hub import save_torch_state_dict

    (folder / "bin").mkdir()
    save_torch_state_dict(_contiguous(sd), folder / "bin", max_shard_size=64, safe_serialization=False)
    return folder / "bin"


def write_module(sd: dict[str, torch.Tensor], folder: Path) -> Path:
    """A whole pickled module (``torch.save(model)``) whose state_dict() is ``sd``: each name a
    buffer of nested modules, ties and views as they are."""
    root = torch.nn.Module()
    for key, t in sd.items():
        *path, leaf = key.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]  # type: ignore[assignment]
        node.register_buffer(leaf, t)
    torch.save(root, folder / "module.pt")
    return folder / "module.pt"


SOURCES: dict[str, Callable[[dict[str, torch.Tensor], Path], Path]] = {
    "torch": write_torch,
    "safetensors": write_safetensors,
    "hf": write_hf,
    "hf-bin": write_hf_bin,
    "dcp": write_dcp,
    "module": write_module,
}


# -- the outputs, each read back by its peer's reader --------------------------------------------


def read_output(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if path.suffix == ".pt":
        return dict(torch.load(path, weights_only=True))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    if path.suffix == ".dcp":
        import torch.distributed.checkpoint as dcp

        got = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in like.items()}
        dcp.load(got, checkpoint_id=path, **LOAD_ALONE)
        return got
    from huggingface_hub import load_state_dict_from_file

    index = next(path.glob("*.index.json"), None)
    files = sorted(path.glob("*.safetensors")) if index is not None else [next(path.glob("*.safetensors"))]
    return {k: v for f in files for k, v in load_state_dict_from_file(f).items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit for bit. A name tied to another may be missing where the peer's reader leaves re-tying
    to the model (safetensors' aliases, HF's dropped ties): then the names it is tied to are there."""
    for k in set(want) - set(got):
        assert any(want[k] is v and o in got for o, v in want.items() if o != k), f"{k} missing"
        got = {**got, k: got[next(o for o, v in want.items() if v is want[k] and o in got)]}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bytes(got[k]), _bytes(v)), k  # bit for bit: -0.0 is not 0.0


def convert(src: Path, dst: Path, *args: str) -> tuple[int, str]:
    folder = dst.suffix == ""  # Hugging Face shards: DST names a folder with a trailing /
    result = CliRunner().invoke(main, ["convert", str(src), f"{dst}/" if folder else str(dst), *args])
    return result.exit_code, result.output


def check(src: Path, dst: Path, args: list[str], want: dict[str, torch.Tensor]) -> None:
    code, out = convert(src, dst, *args)
    leftovers = [p for p in dst.parent.iterdir() if p.name.endswith(TMP_SUFFIX)]
    assert not leftovers, leftovers
    assert code == 0, f"convert {src.name} {dst.name} {' '.join(args)}: {out}"
    _same(read_output(dst, want), want)
    assert ckptkit.verify_checkpoint(dst).ok


OUTPUTS = {
    "pt": ("out.pt", []),
    "safetensors": ("out.safetensors", []),
    "hf": ("out", ["--max-shard-size", "100"]),
    "dcp": ("out.dcp", ["--format", "dcp"]),
}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("output", list(OUTPUTS))
@ORACLE
@given(sd=state_dicts(), to=st.sampled_from(["single", "ddp", "keep"]))
def test_convert_equals_plain_torch(source: str, output: str, sd: dict[str, torch.Tensor], to: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix="oracle-"))
    try:
        src = SOURCES[source](sd, folder)
        name, extra = OUTPUTS[output]
        rename = {"single": canonical, "ddp": lambda k: "module." + canonical(k), "keep": lambda k: k}[to]
        want = {rename(k): v for k, v in sd.items()}
        check(src, folder / name, [*extra, "--to", to], want)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("output", list(OUTPUTS))
@ORACLE
@given(
    sd=state_dicts(),
    pick=st.integers(min_value=-1, max_value=3),
    strip=st.sampled_from([None, "dec.", "head."]),
    add=st.sampled_from([None, "net."]),
)
def test_selections_equal_plain_torch(
    source: str, output: str, sd: dict[str, torch.Tensor], pick: int, strip: str | None, add: str | None
) -> None:
    """--model-only with --key (a path, a prefix, both), --strip and --add. A torch source is a
    training checkpoint (--key model, model/PREFIX); the others hold the weights alone (PREFIX).
    The prefix is one key's (``pick``; -1: none) up to its first segment that is not a wrapper,
    so it selects that module's weights, usually a part of them."""
    prefix = ""
    if pick >= 0:
        parts = list(sd)[pick % len(sd)].split(".")
        head = next((i for i, p in enumerate(parts) if p not in WRAPPERS), len(parts))
        prefix = ".".join(parts[: head + 1]) + "." if head < len(parts) - 1 else ""
    folder = Path(tempfile.mkdtemp(prefix="oracle-"))
    try:
        if source == "torch":
            ckpt = {"model": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, "step": 7}
            src, key = write_torch(ckpt, folder), f"model/{prefix}" if prefix else "model"  # type: ignore[arg-type]
        else:
            src, key = SOURCES[source](sd, folder), prefix
        name, extra = OUTPUTS[output]
        args = [*extra, "--model-only", *(["--key", key] if key else [])]
        # The documented order: the prefix selected (and removed), wrappers removed, --strip, --add.
        chosen = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        want = {canonical(k): v for k, v in chosen.items()}
        if strip:
            args += ["--strip", strip]
            want = {k.removeprefix(strip): v for k, v in want.items()}
        if add:
            args += ["--add", add]
            want = {add + k: v for k, v in want.items()}
        if not chosen or len(want) < len(chosen):  # nothing selected, or two names merged: refused
            code, out = convert(src, folder / name, *args)
            assert code in (1, 2) and len(out.strip().splitlines()) == 1 and not (folder / name).exists(), out
            return
        check(src, folder / name, args, want)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- load_for_rank into a model with real ties ----------------------------------------------------


class TiedNet(torch.nn.Module):
    """A language model's shape in little: the head shares the embedding's weight."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4, dtype=dtype)
        self.body = torch.nn.Linear(4, 4, dtype=dtype)
        self.norm = torch.nn.LayerNorm(4, dtype=dtype)
        self.head = torch.nn.Linear(4, 7, bias=False, dtype=dtype)
        self.head.weight = self.emb.weight


def _save_model(model: torch.nn.Module, folder: Path, how: str, wrapper: str) -> Path:
    """``model`` saved as users save it: a wrapped state dict or a training checkpoint through
    torch, safetensors' ``save_model`` and huggingface_hub (which store the tie once), DCP."""
    sd = {wrapper + k: v for k, v in model.state_dict().items()}
    if how == "torch":
        torch.save(sd, folder / "m.pt")
        return folder / "m.pt"
    if how == "training":
        torch.save({"model": sd, "optimizer": {"state": {}, "param_groups": []}, "epoch": 3}, folder / "m.pt")
        return folder / "m.pt"
    if how == "safetensors":
        from safetensors.torch import save_model

        save_model(model, str(folder / "m.safetensors"))
        return folder / "m.safetensors"
    if how in ("hf", "hf-bin"):
        from huggingface_hub import save_torch_state_dict

        (folder / how).mkdir()
        save_torch_state_dict(model.state_dict(), folder / how, max_shard_size=200, safe_serialization=how == "hf")
        return folder / how
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, checkpoint_id=folder / "m.dcp", **SAVE_ALONE)
    return folder / "m.dcp"


@pytest.mark.parametrize("how", ["torch", "training", "safetensors", "hf", "hf-bin", "dcp"])
@ORACLE
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    wrapper=st.sampled_from(["", "module.", "_orig_mod.", "module._orig_mod."]),
)
def test_load_for_rank_fills_a_tied_model_like_plain_torch(
    how: str, seed: int, dtype: torch.dtype, wrapper: str
) -> None:
    """The oracle: the saved model's own state_dict(). The tie must hold after the load (the head
    is still the embedding), and every value equal bit for bit."""
    torch.manual_seed(seed)
    saved = TiedNet(dtype)
    folder = Path(tempfile.mkdtemp(prefix="oracle-"))
    try:
        path = _save_model(saved, folder, how, wrapper)
        fresh = TiedNet(dtype)
        ckptkit.load_for_rank(path, model=fresh)
        assert fresh.head.weight is fresh.emb.weight
        _same(dict(fresh.state_dict()), dict(saved.state_dict()))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
