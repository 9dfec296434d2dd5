"""Tied weights stored once (issue 24, defect 3): safetensors' ``save_model``, ``save_pretrained``
and Accelerate keep one name of each group of tensors that share memory; loading fills the
others from it, as ``safetensors.torch.load_model`` does, and the model's ties survive."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.nn as nn

import ckptkit
from fixtures.models import TiedLM

WRAPS: dict[str, Callable[[nn.Module], nn.Module]] = {"plain": lambda m: m, "DataParallel": nn.DataParallel}


def _lm(seed: int) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def assert_loaded_and_tied(model: nn.Module, source: TiedLM) -> None:
    """Every value equals the source's, exactly, and head.weight is still embed.weight."""
    lm = ckptkit.unwrap_model(model)
    want = source.state_dict()
    got = lm.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert lm.head.weight is lm.embed.weight and _same_memory(lm.head.weight, lm.embed.weight)


@pytest.mark.parametrize("saved_from", list(WRAPS))
@pytest.mark.parametrize("into", list(WRAPS))
def test_safetensors_save_model_loads_like_load_model(tmp_path: Path, saved_from: str, into: str) -> None:
    source = _lm(0)
    path = tmp_path / "tied.safetensors"
    st.save_model(WRAPS[saved_from](source), str(path))
    stored = set(st.load_file(str(path)))
    assert not {k for k in stored if k.endswith("head.weight")}, "safetensors stored both names: nothing to test"
    model = WRAPS[into](_lm(1))
    assert not torch.equal(ckptkit.unwrap_model(model).embed.weight, source.embed.weight)
    ckptkit.load_for_rank(path, model=model)
    assert_loaded_and_tied(model, source)
    if saved_from == into:  # safetensors' own loader matches names exactly: the same result
        reference = WRAPS[into](_lm(2))
        st.load_model(reference, str(path))
        assert_loaded_and_tied(reference, source)


@pytest.mark.parametrize("dropped", ["head.weight", "embed.weight"])
@pytest.mark.parametrize("prefix", ["", "module."])
@pytest.mark.parametrize("into", list(WRAPS))
def test_torch_checkpoint_with_one_tied_name(tmp_path: Path, dropped: str, prefix: str, into: str) -> None:
    source = _lm(0)
    sd = ckptkit.add_prefix(source.state_dict(), prefix) if prefix else source.state_dict()
    del sd[prefix + dropped]
    torch.save({"model": sd, "epoch": 3}, tmp_path / "tied.pt")
    model = WRAPS[into](_lm(1))
    ckpt = ckptkit.load_for_rank(tmp_path / "tied.pt", model=model)
    assert_loaded_and_tied(model, source)
    assert prefix + dropped not in ckpt["model"]  # the caller's checkpoint is left as read


def test_tied_weights_under_a_non_wrapper_prefix(tmp_path: Path) -> None:
    """A training module's checkpoint (``net.`` beside a loss's state) found by name and shape."""
    source = _lm(0)
    sd = {f"net.{k}": v for k, v in source.state_dict().items() if k != "head.weight"}
    torch.save({**sd, "loss.scale": torch.ones(1)}, tmp_path / "module.pt")
    model = _lm(1)
    with pytest.warns(UserWarning, match="loaded the weights under 'net.'"):
        ckptkit.load_for_rank(tmp_path / "module.pt", model=model)
    assert_loaded_and_tied(model, source)


@pytest.mark.parametrize("dropped", ["head.weight", "embed.weight"])
@pytest.mark.parametrize("into", list(WRAPS))
def test_load_training_state_fills_tied_weights(tmp_path: Path, dropped: str, into: str) -> None:
    source, ema = _lm(0), _lm(5)
    path = tmp_path / "state.pt"
    ckptkit.save_training_state(path, model=nn.DataParallel(source), epoch=2, stateful={"ema": ema})
    ckpt = torch.load(path, weights_only=True)
    assert dropped in ckpt["model"]
    del ckpt["model"][dropped], ckpt["stateful"]["ema"][dropped]  # as a writer that stores ties once
    torch.save(ckpt, path)
    model, restored_ema = WRAPS[into](_lm(1)), _lm(6)
    state = ckptkit.load_training_state(path, model=model, stateful={"ema": restored_ema})
    assert state.epoch == 2
    assert_loaded_and_tied(model, source)
    assert_loaded_and_tied(restored_ema, ema)


class _Viewed(nn.Module):
    """A buffer that views a parameter's memory: stored once by safetensors, like a tie."""

    def __init__(self, view: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        views = {"row": lambda w: w[1], "column": lambda w: w[:, 2], "transpose": lambda w: w.t()}
        self.register_buffer("v", views[view](self.w.data))


@pytest.mark.parametrize("view", ["row", "column", "transpose"])
def test_buffer_viewing_a_parameter(tmp_path: Path, view: str) -> None:
    torch.manual_seed(0)
    source = _Viewed(view)
    if view == "transpose":  # save_model cannot find its own ties here (its _end_ptr views it flat)
        st.save_file({"w": source.w.detach()}, str(tmp_path / "viewed.safetensors"))
    else:
        st.save_model(source, str(tmp_path / "viewed.safetensors"))
    assert list(st.load_file(str(tmp_path / "viewed.safetensors"))) == ["w"]
    torch.manual_seed(1)
    model = _Viewed(view)
    ckptkit.load_for_rank(tmp_path / "viewed.safetensors", model=model)
    assert torch.equal(model.w, source.w) and torch.equal(model.v, source.v)
    assert _same_memory(model.v, model.w)
    model.w.data.zero_()  # the view still sees the parameter's memory
    assert not model.v.any()


def test_truly_absent_key_is_still_an_error(tmp_path: Path) -> None:
    source = _lm(0)
    sd = {k: v for k, v in source.state_dict().items() if k not in ("head.weight", "norm.weight")}
    st.save_file(sd, str(tmp_path / "partial.safetensors"))
    model = _lm(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckptkit.errors.StateDictMismatchError, match=r"1 missing key\(s\) \(norm.weight\)") as e:
        ckptkit.load_for_rank(tmp_path / "partial.safetensors", model=model)
    assert e.value.missing == ["norm.weight"] and not e.value.unexpected and not e.value.mismatched
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing was changed
    ckptkit.load_for_rank(tmp_path / "partial.safetensors", model=model, strict=False)
    assert torch.equal(model.head.weight, source.embed.weight) and model.head.weight is model.embed.weight
    assert torch.equal(model.norm.weight, before["norm.weight"])


def test_mis_shaped_tied_source_is_one_mismatch(tmp_path: Path) -> None:
    source = TiedLM(vocab=16)
    st.save_model(source, str(tmp_path / "small.safetensors"))
    with pytest.raises(
        ckptkit.errors.StateDictMismatchError, match=r"embed.weight: checkpoint \[16, 8\] vs model \[32, 8\]"
    ) as e:
        ckptkit.load_for_rank(tmp_path / "small.safetensors", model=TiedLM(vocab=32))
    assert e.value.mismatched == [("embed.weight", (16, 8), (32, 8))]
    assert not e.value.missing and not e.value.unexpected  # head.weight is embed.weight: not absent too
