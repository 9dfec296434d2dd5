"""--hf-llama: a torchtitan Llama as transformers loads it, checked against torchtitan's own
converter (Llama3StateDictAdapter.to_hf) and against transformers' forward pass."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptkit
from ckptkit.errors import ArgumentError
from ckptkit.formats.entry import Bytes
from ckptkit.model.hf_llama import PermutedRows, rope_rows
from tests.torchcompat import SAVE_ALONE
from tests.torchfree import run_torch_free


def _hf_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's conversion script's (and torchtitan's to_hf) permutation, as they write it."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@settings(max_examples=200, deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 5), cols=st.integers(1, 4))
def test_rope_rows_is_hfs_permutation(heads: int, half: int, cols: int) -> None:
    w = torch.arange(heads * half * 2 * cols).reshape(heads * half * 2, cols)
    assert torch.equal(w[rope_rows(w.shape[0], heads)], _hf_permute(w, heads))


@settings(max_examples=200, deadline=None)
@given(
    heads=st.integers(1, 4),
    half=st.integers(1, 4),
    cols=st.integers(1, 3),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_rows_permuted_as_they_stream_in_any_pieces(heads: int, half: int, cols: int, cuts: list[int]) -> None:
    w = torch.randn(heads * half * 2, cols)
    data = w.numpy().tobytes()
    edges = sorted({0, len(data), *(c for c in cuts if c < len(data))})

    def copy(f: Any, progress: Any) -> int:  # the source's bytes, in pieces of any size
        for a, b in zip(edges, edges[1:], strict=False):
            f.write(data[a:b])
        return zlib.crc32(data)

    out = io.BytesIO()
    crc = PermutedRows(Bytes("float32", tuple(w.shape), len(data), copy), heads).write(out)
    want = _hf_permute(w, heads).contiguous().numpy().tobytes()
    assert out.getvalue() == want and crc == zlib.crc32(want)


def _config(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **fields}))
    return path


def test_torchtitans_folder_converts_torch_free_with_its_heads_permuted(fixtures_dir: Path, tmp_path: Path) -> None:
    folder = fixtures_dir / "frameworks" / "torchtitan" / "step-2"  # torchtitan's older names: wq, output
    config = _config(tmp_path, num_attention_heads=2)
    proc, imported_torch = run_torch_free(["convert", folder, f"{tmp_path}/hf/", "--hf-llama", config, "--json"])
    assert proc.returncode == 0 and not imported_torch, proc.stderr
    report = json.loads(proc.stdout)
    assert report["fast"] is True and report["renamed"] == 5 and "optimizer" in report["dropped"], report
    dcp_to_torch_save(folder, tmp_path / "torch.pt")
    titan = torch.load(tmp_path / "torch.pt", weights_only=False)
    got = ckptkit.read_checkpoint(tmp_path / "hf")
    assert sorted(got) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
    ]
    assert torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], _hf_permute(titan["layers.0.attention.wq.weight"], 2)
    )
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], titan["layers.0.attention.wq.weight"])
    assert torch.equal(got["lm_head.weight"], titan["output.weight"])
    assert (tmp_path / "hf" / "config.json").read_bytes() == config.read_bytes()
    assert ckptkit.verify_checkpoint(tmp_path / "hf").ok


def test_the_torch_path_permutes_as_the_stream_does(fixtures_dir: Path, tmp_path: Path) -> None:
    folder = fixtures_dir / "frameworks" / "torchtitan" / "step-2"
    dcp_to_torch_save(folder, tmp_path / "titan.pt")
    legacy = tmp_path / "legacy.pt"  # a legacy (non-zip) file: read with torch
    torch.save(torch.load(tmp_path / "titan.pt", weights_only=False), legacy, _use_new_zipfile_serialization=False)
    config = _config(tmp_path, num_attention_heads=2)
    torch_path = ckptkit.convert_checkpoint(legacy, tmp_path / "a.safetensors", hf_llama=config)
    stream = ckptkit.convert_checkpoint(folder, tmp_path / "b.safetensors", hf_llama=config)
    assert not torch_path.fast and stream.fast
    a, b = ckptkit.read_checkpoint(tmp_path / "a.safetensors"), ckptkit.read_checkpoint(tmp_path / "b.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert any("config.json is not written into a safetensors output" in n for n in stream.notes)


def test_a_tied_head_is_left_out_as_torchtitan_does(fixtures_dir: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, num_attention_heads=2, tie_word_embeddings=True)
    folder = fixtures_dir / "frameworks" / "torchtitan" / "step-2"
    report = ckptkit.convert_checkpoint(folder, f"{tmp_path}/hf/", hf_llama=config)
    assert "lm_head.weight" not in ckptkit.read_checkpoint(tmp_path / "hf") and report.tensors == 4
    assert any(n.startswith("output.weight not written: config.json ties lm_head") for n in report.notes)


def test_what_is_not_a_llama_is_refused_before_anything_is_written(fixtures_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="knows torchtitan's Llama weights, not fc1.weight"):
        ckptkit.convert_checkpoint(
            fixtures_dir / "ddp.pt", f"{tmp_path}/a/", hf_llama=_config(tmp_path, num_attention_heads=2)
        )
    with pytest.raises(ArgumentError, match="naming num_attention_heads"):
        ckptkit.convert_checkpoint(fixtures_dir / "ddp.pt", f"{tmp_path}/b/", hf_llama=_config(tmp_path, hidden_size=8))
    folder = fixtures_dir / "frameworks" / "torchtitan" / "step-2"
    with pytest.raises(
        ArgumentError,
        match=r"layers.0.attention.wq.weight is \[8, 8\], which 3 heads \(.*config.json's num_attention_heads\)",
    ):
        ckptkit.convert_checkpoint(folder, f"{tmp_path}/c/", hf_llama=_config(tmp_path, num_attention_heads=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def _torchtitan_llama() -> tuple[Any, Any, dict[str, int]]:
    """A tiny torchtitan Llama 3 (grouped-query attention: 4 heads, 2 kv heads), built by
    torchtitan's own config builders as its flavors are; and its size."""
    from fixtures.make_framework_fixtures import torchvision_importable

    torchvision_importable()  # transformers imports it
    titan = pytest.importorskip(
        "torchtitan.models.llama3", reason="torchtitan is not installed (pip install torchtitan)"
    )
    common = pytest.importorskip("torchtitan.models.common")
    from torchtitan.models.common.rope import ComplexRoPE

    size = {"dim": 64, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 128, "hidden": 192}
    config = titan.Llama3Model.Config(
        dim=size["dim"],
        vocab_size=size["vocab"],
        tok_embeddings=common.Embedding.Config(
            num_embeddings=size["vocab"], embedding_dim=size["dim"], param_init=titan._EMBEDDING_INIT
        ),
        norm=common.RMSNorm.Config(normalized_shape=size["dim"], param_init=titan._NORM_INIT),
        lm_head=common.Linear.Config(
            in_features=size["dim"], out_features=size["vocab"], param_init=titan._output_linear_init(size["dim"])
        ),
        layers=titan._build_llama3_layers(
            fuse_qkv=True,
            n_layers=size["layers"],
            dim=size["dim"],
            n_heads=size["heads"],
            n_kv_heads=size["kv_heads"],
            hidden_dim=size["hidden"],
            rope=ComplexRoPE.Config(dim=size["dim"] // size["heads"], max_seq_len=64, theta=500000.0),
            attn_backend="flex",
        ),
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=None)
    with torch.no_grad():  # torchtitan's small init leaves attention near uniform and faint: make it count
        for name, p in model.named_parameters():
            if ".attention." in name:
                p.mul_(30)
    return model, config, size


def test_matches_torchtitans_converter_and_transformers_gives_its_logits(tmp_path: Path) -> None:
    model, config, size = _torchtitan_llama()
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    state = model.state_dict()
    dcp.save(state, checkpoint_id=tmp_path / "step-10", **SAVE_ALONE)
    hf_config = transformers.LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["dim"],
        intermediate_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    hf_config.save_pretrained(tmp_path / "assets")  # the config.json a user has from the HF assets
    report = ckptkit.convert_checkpoint(
        tmp_path / "step-10", f"{tmp_path}/hf/", hf_llama=tmp_path / "assets" / "config.json"
    )
    assert report.fast
    want = Llama3StateDictAdapter(config, None).to_hf(state)
    got = ckptkit.read_checkpoint(tmp_path / "hf")
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, size["vocab"], (1, 12))
    positions = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        titan_logits = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
        hf_logits = hf(tokens).logits
    assert torch.allclose(hf_logits, titan_logits, atol=1e-4, rtol=1e-4), (hf_logits - titan_logits).abs().max()
    # the names alone (no permutation) give other logits: the check can tell
    plain = transformers.LlamaForCausalLM(hf_config).eval()
    plain.load_state_dict({k: state[t] for k, t in zip(want, state, strict=True)})
    with torch.no_grad():
        assert (plain(tokens).logits - titan_logits).abs().max() > 0.1


def test_config_json_mistakes_are_named(fixtures_dir: Path, tmp_path: Path) -> None:
    folder = fixtures_dir / "frameworks" / "torchtitan" / "step-2"
    with pytest.raises(ckptkit.errors.CheckpointNotFoundError, match="nosuch.json does not exist"):
        ckptkit.convert_checkpoint(folder, f"{tmp_path}/a/", hf_llama=tmp_path / "nosuch.json")
    with pytest.raises(ArgumentError, match="gives num_key_value_heads 0"):  # was: taken as num_attention_heads
        ckptkit.convert_checkpoint(
            folder, f"{tmp_path}/b/", hf_llama=_config(tmp_path, num_attention_heads=2, num_key_value_heads=0)
        )
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text('{"num_attention_heads": 2}')
    ckptkit.convert_checkpoint(folder, f"{tmp_path}/c/", hf_llama=assets)  # the HF assets folder holding it
    # was: refused, config.json not being a Hugging Face weight file
    ckptkit.convert_checkpoint(folder, f"{tmp_path}/c/", hf_llama=assets, force=True)
    assert (tmp_path / "c" / "config.json").read_text() == '{"num_attention_heads": 2}'


def test_two_weights_named_alike_are_refused(tmp_path: Path) -> None:
    torch.save(
        {
            "tok_embeddings.weight": torch.ones(4, 2),
            "output.weight": torch.zeros(4, 2),
            "lm_head.weight": torch.ones(4, 2),
        },
        tmp_path / "t.pt",
    )
    with pytest.raises(ArgumentError, match="output.weight and lm_head.weight would both be written as lm_head.weight"):
        ckptkit.convert_checkpoint(
            tmp_path / "t.pt", tmp_path / "o.safetensors", hf_llama=_config(tmp_path, num_attention_heads=2)
        )
    assert not (tmp_path / "o.safetensors").exists()


def test_the_torch_path_writes_config_json_into_a_folder(fixtures_dir: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, num_attention_heads=2)
    report = ckptkit.convert_checkpoint(
        fixtures_dir / "frameworks" / "torchtitan" / "step-2", f"{tmp_path}/hf/", hf_llama=config, trust=True
    )
    assert not report.fast  # was: written without config.json, and nothing said
    assert (tmp_path / "hf" / "config.json").read_bytes() == config.read_bytes()
