"""torchao-quantized checkpoints, as torchao and transformers write them (``fixtures/frameworks/torchao/``).

A ``save_pretrained`` folder stores each ``Int8Tensor`` as plain tensors (``_weight_qdata``,
``_weight_scale``) described by entries of every shard's safetensors metadata; an output without
those entries cannot be loaded by ``from_pretrained`` ("Invalid torchao safetensors metadata").
A ``torch.save`` of the quantized state dict pickles the subclasses themselves: safetensors cannot
hold them, and saying so takes one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import ckptkit
from ckptkit.errors import UnsupportedCheckpointError
from tests.cli.test_cli import run
from tests.formats.test_producers import _framework

TORCHAO = Path(__file__).resolve().parents[2] / "fixtures" / "frameworks" / "torchao"
HF_FOLDER = TORCHAO / "hf"


def _metadata(files: list[Path]) -> list[dict[str, str]]:
    out = []
    for f in files:
        with safe_open(f, "pt") as st:
            out.append({k: v for k, v in (st.metadata() or {}).items() if not k.startswith("ckptkit.")})
    return out


@pytest.mark.parametrize("shards", [None, "6kB"], ids=["one_file", "shards"])
def test_a_torchao_folder_converts_to_a_folder_transformers_loads(tmp_path: Path, shards: str | None) -> None:
    out = tmp_path / "out"
    ckptkit.convert_checkpoint(HF_FOLDER, f"{out}/", max_shard_size=shards)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == (1 if shards is None else 2), files
    source = _metadata(sorted(HF_FOLDER.glob("*.safetensors")))
    assert all(m == source[0] for m in source)  # transformers writes the same entries in every shard
    assert all(m == source[0] for m in _metadata(files)), "torchao's entries are carried to every shard"
    for name in ("config.json", "generation_config.json"):
        shutil.copy(HF_FOLDER / name, out)
    transformers = _framework("transformers")
    _framework("torchao")
    want = transformers.LlamaForCausalLM.from_pretrained(HF_FOLDER)
    got = transformers.LlamaForCausalLM.from_pretrained(out)
    assert type(got.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    x = torch.arange(12)[None]
    assert torch.equal(got(x).logits, want(x).logits)
    _same_state(got.state_dict(), want.state_dict())


def _same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if type(v).__name__ == "Int8Tensor":
            assert torch.equal(got[k].qdata, v.qdata) and torch.equal(got[k].scale, v.scale), k
        else:
            assert torch.equal(got[k], v), k


def test_torchaos_subclasses_to_safetensors_are_refused_in_one_line(tmp_path: Path) -> None:
    _framework("torchao")  # unpickling the Int8Tensors imports torchao
    src, out = TORCHAO / "state_dict.pt", tmp_path / "out.safetensors"
    with pytest.raises(UnsupportedCheckpointError, match=r"Int8Tensor \(a tensor subclass") as e:
        ckptkit.convert_checkpoint(src, out, trust=True)
    assert "write a .pt file instead" in str(e.value) and not out.exists()
    code, _, err = run("convert", src, out, "--trust")
    assert code == 1 and err.startswith(
        "ckptkit: error: model.layers.0.self_attn.q_proj.weight is a torchao Int8Tensor"
    )
    assert err.count("\n") == 1, err  # no traceback, no torchao or torch log lines
    # The advice, followed: a .pt holds them, and torch loads them back as they were.
    code, _, err = run("convert", src, tmp_path / "out.pt", "--trust")
    assert code == 0, err
    _same_state(torch.load(tmp_path / "out.pt", weights_only=False), torch.load(src, weights_only=False))
