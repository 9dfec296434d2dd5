from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ckptkit
from fixtures.models import TiedLM, TinyNet

WRAPPED_FIXTURES = {
    "plain.pt": "",
    "dp.pth": "module.",
    "ddp.pt": "module.",
    "compiled.pt": "_orig_mod.",
    "compiled_of_ddp.pt": "_orig_mod.module.",
    "ddp_of_compiled.pt": "module._orig_mod.",
    "legacy_ddp.pt": "module.",
}


def targets() -> dict[str, nn.Module]:
    """The target wrappings a user loads into (DDP has DataParallel's keys; see test_dist for live DDP)."""
    return {
        "plain": TinyNet(),
        "dataparallel": nn.DataParallel(TinyNet()),
        "compiled": torch.compile(TinyNet()),
        "compiled(dataparallel)": torch.compile(nn.DataParallel(TinyNet())),
        "dataparallel(compiled)": nn.DataParallel(torch.compile(TinyNet())),
    }


def load(path: Path) -> OrderedDict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_strip_prefix_keeps_values_order_and_metadata() -> None:
    sd = nn.DataParallel(TinyNet()).state_dict()
    out = ckptkit.strip_prefix(sd)
    assert list(out) == [k.removeprefix("module.") for k in sd]
    assert all(out[k.removeprefix("module.")] is v for k, v in sd.items())  # no tensor copied
    assert out._metadata == TinyNet().state_dict()._metadata
    assert list(sd)[0].startswith("module.")  # input untouched


def test_strip_prefix_only_strips_keys_that_have_it() -> None:
    out = ckptkit.strip_prefix({"module.a": 1, "b": 2, "x.module.c": 3})
    assert list(out.items()) == [("a", 1), ("b", 2), ("x.module.c", 3)]


def test_add_prefix_matches_a_real_wrapper() -> None:
    inner = TinyNet()
    out = ckptkit.add_prefix(inner.state_dict())
    wrapped = nn.DataParallel(inner).state_dict()
    assert list(out) == list(wrapped)
    assert out._metadata == wrapped._metadata
    nn.DataParallel(TinyNet()).load_state_dict(out, strict=True)


@pytest.mark.parametrize("prefix", ["module", "", ".", "a..b.", 3])
def test_bad_prefix_is_refused(prefix: object) -> None:
    with pytest.raises(ckptkit.errors.ArgumentError, match="prefix must be"):
        ckptkit.strip_prefix({"a": 1}, prefix)  # type: ignore[arg-type]


def test_strip_refuses_to_merge_wrapped_and_plain_names() -> None:
    with pytest.raises(ckptkit.errors.ArgumentError, match="merge 1 keys"):
        ckptkit.strip_prefix({"module.fc.weight": 1, "fc.weight": 2})


@pytest.mark.parametrize("name,prefix", WRAPPED_FIXTURES.items())
def test_detect_prefixes_on_fixtures(fixtures_dir: Path, name: str, prefix: str) -> None:
    info = ckptkit.prefix.detect_prefixes(load(fixtures_dir / name))
    assert info.prefix == prefix
    assert info.wrapped == bool(prefix)
    assert info.nested == ()


def test_detect_prefixes_finds_nested_wrappers_and_common_prefix() -> None:
    info = ckptkit.prefix.detect_prefixes(["model.encoder._orig_mod.w", "model.head.w"])
    assert info.leading == ()
    assert info.nested == ("model.encoder._orig_mod.",)
    assert info.common == "model."
    assert ckptkit.prefix.detect_prefixes({}).leading == ()


@pytest.mark.parametrize("name", WRAPPED_FIXTURES)
@pytest.mark.parametrize("target_name", list(targets()))
def test_every_fixture_loads_strictly_into_every_wrapping(fixtures_dir: Path, name: str, target_name: str) -> None:
    source = load(fixtures_dir / name)
    target = targets()[target_name]
    adapted = ckptkit.prefix.adapt_state_dict(source, target)
    target.load_state_dict(adapted, strict=True)
    plain = ckptkit.unwrap_model(target).state_dict()
    reference = load(fixtures_dir / "plain.pt")
    assert list(plain) == list(reference)
    assert all(torch.equal(plain[k], reference[k]) for k in reference)
    # BatchNorm's version (2) must sit at the BatchNorm's own path in the target.
    bn_path = next(k for k in adapted if k.endswith("bn.weight")).removesuffix(".weight")
    assert adapted._metadata[bn_path] == {"version": 2}


def test_adapt_round_trip_keeps_order_identity_and_metadata(fixtures_dir: Path) -> None:
    ddp = load(fixtures_dir / "ddp.pt")
    plain = ckptkit.prefix.adapt_state_dict(ddp, TinyNet())
    back = ckptkit.prefix.adapt_state_dict(plain, nn.DataParallel(TinyNet()))
    assert list(back) == list(ddp)
    assert all(back[k] is ddp[k] for k in ddp)
    assert back._metadata == ddp._metadata


def test_adapt_to_key_collection_and_unmatched_keys_keep_names() -> None:
    out = ckptkit.prefix.adapt_state_dict({"module.a.w": 1, "module.extra": 2}, ["a.w", "b.w"])
    assert list(out.items()) == [("a.w", 1), ("extra", 2)]


def test_adapt_handles_wrappers_below_the_root() -> None:
    source = {"encoder.module.fc.weight": 1, "head._orig_mod.weight": 2}
    out = ckptkit.prefix.adapt_state_dict(source, ["encoder.fc.weight", "head.weight"])
    assert list(out.items()) == [("encoder.fc.weight", 1), ("head.weight", 2)]


def test_adapt_with_lightning_prefix(fixtures_dir: Path) -> None:
    ckpt = load(fixtures_dir / "lightning.ckpt")
    model = TinyNet()
    adapted = ckptkit.prefix.adapt_state_dict(ckpt["state_dict"], model, wrappers=("model.",))
    model.load_state_dict(adapted, strict=True)


def test_tied_weights_survive_adaptation(fixtures_dir: Path) -> None:
    lm = TiedLM()
    lm.load_state_dict(ckptkit.prefix.adapt_state_dict(load(fixtures_dir / "tied_ddp.pt"), lm), strict=True)
    assert lm.head.weight is lm.embed.weight


def test_optimizer_state_is_untouched_by_key_rewrites(fixtures_dir: Path) -> None:
    ckpt = load(fixtures_dir / "train_ckpt.pt")
    before = {k: v.clone() for k, v in ckpt["optimizer"]["state"][0].items()}
    model = TinyNet()
    model.load_state_dict(ckptkit.prefix.adapt_state_dict(ckpt["model"], model))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["optimizer"])  # keyed by parameter index: still valid
    assert all(torch.equal(opt.state[model.fc1.weight][k], v) for k, v in before.items())


def test_unwrap_model_any_nesting() -> None:
    inner = TinyNet()
    assert ckptkit.unwrap_model(torch.compile(nn.DataParallel(torch.compile(inner)))) is inner
    assert ckptkit.unwrap_model(inner) is inner
