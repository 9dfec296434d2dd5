"""inspect: each key listed once, tied storage counted once, and how a trusted file was loaded."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.model.layout import find_model_state
from fixtures.models import TinyNet


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


# -- inspect --trust says how it loaded -----------------------------------------------------


# Was: `inspect --trust` claims "(loaded with torch, weights-only)" after weights_only=False.
def test_inspect_trust_does_not_claim_weights_only(fixtures_dir: Path) -> None:
    code, out, err = run("inspect", fixtures_dir / "needs_trust.pt", "--trust")
    assert code == 0, err
    assert "weights-only" not in out
    assert "trust" in out


# -- inspect of a flat state dict; bytes of tied tensors -----------------------------------


# Was: inspect of a flat state dict lists every key twice.
def test_inspect_flat_state_dict_lists_each_key_once(fixtures_dir: Path) -> None:
    keys = [
        k
        for k in torch.load(fixtures_dir / "plain.pt", weights_only=True)
        if not any(part.isdigit() for part in k.split("."))
    ]
    assert len(keys) == 9
    code, out, err = run("inspect", fixtures_dir / "plain.pt")
    assert code == 0, err
    for key in keys:
        assert sum(key in line.split() for line in out.splitlines()) == 1, (key, out)


# Was: bytes_by_dtype counts a tied tensor once per name instead of once per storage.
def test_inspect_counts_tied_storage_once(fixtures_dir: Path) -> None:
    obj = torch.load(fixtures_dir / "tied_ddp.pt", weights_only=True)
    state = find_model_state(obj)[1]
    seen: dict[int, int] = {}
    for t in state.values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert len(seen) < len(state)  # the fixture does hold a tied pair
    summary = ckptkit.inspect_checkpoint(fixtures_dir / "tied_ddp.pt")
    assert sum(summary.bytes_by_dtype.values()) == sum(seen.values())


def test_a_trainer_folder_is_named_whichever_reader_runs(fixtures_dir: Path) -> None:
    """Who wrote a Hugging Face folder comes from its files: with trust (torch reads the weights)
    as without."""
    folder = fixtures_dir / "frameworks" / "trainer" / "checkpoint-2"
    for trust in (False, True):
        summary = ckptkit.inspect_checkpoint(folder, trust=trust)
        assert summary.loaded_with_torch is trust
        assert summary.producer is not None and summary.producer["name"] == "hf-trainer"


def test_inspect_advises_a_strip_only_where_following_it_loads_the_model(fixtures_dir: Path, tmp_path: Path) -> None:
    """The docs' first example (fc.weight, fc.bias) got "--strip fc.", which breaks it; a Lightning
    .ckpt's module attribute is the one shared first name worth stripping."""
    plain = nn.Sequential()
    plain.add_module("fc", nn.Linear(2, 2))
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    said = CliRunner().invoke(main, ["inspect", str(tmp_path / "plain.pt")]).stdout
    assert "--strip" not in said and "plain single-device keys" in said

    said = CliRunner().invoke(main, ["inspect", str(fixtures_dir / "lightning.ckpt")]).stdout
    advice = re.search(r"--strip (\S+) gives the inner model's keys", said)
    assert advice is not None, said
    out = tmp_path / "inner.pt"
    result = CliRunner().invoke(
        main, ["convert", str(fixtures_dir / "lightning.ckpt"), str(out), "--model-only", "--strip", advice[1]]
    )
    assert result.exit_code == 0, result.output
    TinyNet().load_state_dict(torch.load(out, weights_only=True))  # strict: every key as the model names it


def test_inspect_says_what_ckptkit_recorded_in_one_line(tmp_path: Path) -> None:
    """Its own CRC map took a line per few tensors: 116 lines for 600 tensors."""
    ckptkit.write_checkpoint({f"l{i}.weight": torch.ones(2) for i in range(600)}, tmp_path / "m.safetensors")
    said = CliRunner().invoke(main, ["inspect", str(tmp_path / "m.safetensors"), "--all"]).stdout
    (line,) = [line for line in said.splitlines() if line.startswith("Metadata:")]
    assert line == "Metadata: format=pt, ckptkit=CRC-32 of 600 tensors and of the header"
    assert len(said.splitlines()) < 620 and "ckptkit.crc32" not in said
