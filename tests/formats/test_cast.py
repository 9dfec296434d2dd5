"""``convert --dtype``: floating weights cast while copied, torch-free, with torch's values.

Every value is held bit for bit against torch's own ``.to(dtype)``: hypothesis draws bit
patterns (NaN, inf, -0.0, subnormals, values on each rounding boundary) for the codec alone
and for tensors written in every format the fast path reads (torch zip, safetensors, Hugging
Face shards, DCP) and converted to ``.pt`` and ``.safetensors``. NaN stays NaN: torch's own NaN
bits differ by where in a tensor a NaN is (its vectorized body and its scalar tail round NaN
differently), so only NaN positions are compared. Integer and bool tensors, optimizer state,
a damaged source (refused, nothing written) and the report's note are checked too.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.cli import main
from ckptkit.formats.cast import cast_bytes
from tests.io.test_crc import flip
from tests.torchcompat import SAVE_ALONE
from tests.torchfree import run_torch_free

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
TARGETS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
SPECIAL = {  # NaNs (quiet, signalling, negative), inf, -0.0, subnormals, the largest finite, rounding boundaries
    "float16": [0x7E00, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0x3C01, 0x0400],
    "bfloat16": [0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x007F, 0x7F7F, 0x3F81, 0x0080],
    "float32": [
        0x7FC00000,
        0x7F800001,
        0xFFA12345,
        0x7F800000,
        0xFF800000,
        0x80000000,
        0x00000001,
        0x007FFFFF,
        0x7F7FFFFF,
        0x3F808000,
        0x3F818000,
        0x3F807FFF,
        0x3F808001,
        0x477FEFFF,
        0x477FF000,
        0x33000000,
        0x33000001,
        0x387FC000,
        0x7F7FFFFF,
        0x00008000,
    ],
    "float64": [
        0x7FF8000000000000,
        0x7FF0000000000001,
        0xFFF0000020000000,
        0x7FF0000000000000,
        0x8000000000000000,
        0x0000000000000001,
        0x3FF0010000000001,
        0x3FF0010000000000,
        0x3FF0020000000000,
        0x47EFFFFFE0000000,
        0x47EFFFFFF0000000,
        0x3FF0000010000000,
        0x3FF0000010000001,
        0x36A0000000000000,
    ],
}


def bit_patterns(dtype: str, max_size: int = 40) -> st.SearchStrategy[np.ndarray]:
    """Arrays of ``dtype``'s bit patterns: any, near a special one, or of a float hypothesis draws."""
    size = DTYPES[dtype].itemsize
    top = 2 ** (8 * size) - 1
    near = st.sampled_from(SPECIAL[dtype]).flatmap(lambda v: st.integers(max(v - 2, 0), min(v + 2, top)))
    if dtype == "bfloat16":  # a float32's top half
        floats = st.floats(width=32, allow_subnormal=True).map(lambda x: int(np.array(x, "<f4").view("<u4")) >> 16)
    else:
        floats = st.floats(width=8 * size, allow_subnormal=True).map(
            lambda x: int(np.array(x, f"<f{size}").view(f"<u{size}"))
        )
    value = st.one_of(st.integers(0, top), near, floats)
    return st.lists(value, min_size=1, max_size=max_size).map(lambda v: np.array(v, dtype=BITS[size]))


def tensor_of(bits: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(bits.view(f"<i{bits.itemsize}").copy()).view(DTYPES[dtype])


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, but where torch gives NaN: NaN there too (torch's NaN bits depend on position)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    assert torch.equal(got[~nan].view(signed), want[~nan].view(signed))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(list(DTYPES)).flatmap(lambda d: st.tuples(st.just(d), bit_patterns(d))),
    st.sampled_from(list(TARGETS)),
)
def test_the_codec_gives_torchs_values(drawn: tuple[str, np.ndarray], target: str) -> None:
    src, bits = drawn
    t = tensor_of(bits, src)
    want = t.to(TARGETS[target])
    got = torch.frombuffer(bytearray(bytes(cast_bytes(bits.tobytes(), src, str(want.dtype)[6:]))), dtype=want.dtype)
    assert_same(got, want)


@pytest.mark.parametrize("src", ["float16", "bfloat16"])
def test_every_16_bit_pattern_casts_as_torch_does(src: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    t = tensor_of(bits, src)
    for target in TARGETS.values():
        got = torch.frombuffer(bytearray(bytes(cast_bytes(bits.tobytes(), src, str(target)[6:]))), dtype=target)
        assert_same(got, t.to(target))


# Was: float8 weights were left as they were; --dtype widens them now, as .to() does.
@pytest.mark.parametrize("src", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_float8_pattern_casts_bit_for_bit_as_torch_does(src: torch.dtype) -> None:
    """All 256 patterns, NaN included: torch gives each fp8 NaN one pattern, so every bit is compared."""
    bits = np.arange(256, dtype=np.uint8)
    t = torch.from_numpy(bits.copy()).view(src)
    for target, ints in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        got = torch.frombuffer(bytearray(bytes(cast_bytes(bits.tobytes(), str(src)[6:], str(target)[6:]))), dtype=ints)
        assert torch.equal(got, t.to(target).view(ints)), (src, target)


# --- every fast-path source, to .pt and .safetensors --------------------------------------------------------------


def write_source(state: dict[str, torch.Tensor], folder: Path, fmt: str) -> Path:
    if fmt == "pt":
        torch.save(state, folder / "src.pt")
        return folder / "src.pt"
    if fmt == "safetensors":  # ckptkit's writer: per-tensor CRC-32s the cast must still check
        ckptkit.write_checkpoint(state, folder / "src.safetensors")
        return folder / "src.safetensors"
    if fmt == "hf":
        from huggingface_hub import save_torch_state_dict

        (folder / "hf").mkdir()
        save_torch_state_dict({k: v for k, v in state.items() if k != "tied"}, folder / "hf", max_shard_size=200)
        return folder / "hf"
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder / "dcp"), **SAVE_ALONE)
    return folder / "dcp"


def load(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return ckptkit.read_checkpoint(path)
    return torch.load(path, weights_only=True)


@st.composite
def states(draw: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(draw(st.lists(st.sampled_from(list(DTYPES)), min_size=1, max_size=4))):
        bits = draw(bit_patterns(dtype, max_size=24))
        t = tensor_of(bits, dtype)
        out[f"layer{i}.weight"] = t.reshape(2, -1) if t.numel() % 2 == 0 else t
    fp8 = draw(st.sampled_from([None, torch.float8_e4m3fn, torch.float8_e5m2]))
    if fp8 is not None:  # any byte is a float8 value (NaN and -0.0 included)
        out["fp8.weight"] = torch.frombuffer(bytearray(draw(st.binary(min_size=1, max_size=24))), dtype=fp8)
    out["steps"] = torch.arange(draw(st.integers(1, 5)), dtype=torch.int64)
    out["mask"] = torch.tensor([True, False, True])
    out["tied"] = out["layer0.weight"]
    return out


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "hf", "dcp"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states())
def test_every_source_casts_to_torchs_values_without_torch(
    tmp_path_factory: pytest.TempPathFactory, fmt: str, state: dict[str, torch.Tensor]
) -> None:
    folder = tmp_path_factory.mktemp(fmt)
    src = write_source(state, folder, fmt)
    for out in (".pt", ".safetensors"):
        for name, target in TARGETS.items():
            dst = folder / f"{name}{out}"
            report = ckptkit.convert_checkpoint(src, dst, dtype=name)  # type: ignore[arg-type]
            assert report.fast, report.fallback_reason
            got = load(dst)
            for k, v in state.items():
                if k == "tied" and fmt == "hf":
                    continue  # huggingface_hub was given no tie to keep
                if v.is_floating_point():
                    assert_same(got[k], v.to(target))
                else:
                    assert got[k].dtype == v.dtype and torch.equal(got[k], v)  # ints and bools untouched
            if (
                fmt in ("pt", "safetensors") and out == ".pt"
            ):  # (DCP stores each name apart; huggingface_hub drops ties)
                assert got["tied"] is got["layer0.weight"]  # ties stay ties


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_deepspeed_folder_and_a_sharded_output_cast_too(fixtures_dir: Path, tmp_path: Path, stage: str) -> None:
    src = fixtures_dir / "deepspeed" / "fp32" / stage
    ckptkit.convert_checkpoint(src, tmp_path / "fp32.safetensors")
    want = load(tmp_path / "fp32.safetensors")
    for name, target in TARGETS.items():
        report = ckptkit.convert_checkpoint(src, tmp_path / f"{name}/", dtype=name, max_shard_size="1kB")  # type: ignore[arg-type]
        assert report.fast and report.shards > 1
        got = ckptkit.read_checkpoint(tmp_path / name)
        assert sorted(got) == sorted(want)  # (shards hold tensors in their own order)
        for k, v in want.items():
            assert_same(got[k], v.to(target) if v.is_floating_point() else v)


def test_a_cast_convert_never_imports_torch(tmp_path: Path) -> None:
    ckptkit.write_checkpoint({"w": torch.randn(64, 64), "n": torch.arange(3)}, tmp_path / "src.safetensors")
    torch.save({"w": torch.randn(8)}, tmp_path / "src.pt")
    proc, imported = run_torch_free(
        ["convert", tmp_path / "src.safetensors", tmp_path / "a.pt", "--dtype", "bf16"],
        ["convert", tmp_path / "src.pt", tmp_path / "b.safetensors", "--dtype", "fp16"],
    )
    assert proc.returncode == 0, proc.stderr
    assert not imported
    assert "cast 1 tensor float32 -> bfloat16" in proc.stderr


def test_a_big_tensor_streams_in_bounded_memory(tmp_path: Path) -> None:
    w = torch.randn(24 << 20)  # 96 MiB: three of the copy's 32 MiB steps
    w[-1] = float("nan")
    torch.save({"w": w}, tmp_path / "src.pt")
    tracemalloc.start()
    try:
        ckptkit.convert_checkpoint(tmp_path / "src.pt", tmp_path / "out.safetensors", dtype="bf16")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 80 << 20, peak  # not the whole tensor, nor its cast
    assert_same(load(tmp_path / "out.safetensors")["w"], w.to(torch.bfloat16))


# --- what is left alone, what is reported, what is refused --------------------------------------------------------


def test_only_the_weights_are_cast_and_the_report_says_what(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = {
        "model": {f"module.{k}": v for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "epoch": 2,
    }
    state["model"]["module.fp8"] = torch.ones(2).to(torch.float8_e4m3fn)
    state["model"]["module.z"] = torch.ones(2, dtype=torch.complex64)
    state["model"]["module.n"] = torch.arange(3, dtype=torch.int32)
    torch.save(state, tmp_path / "ckpt.pt")
    report = ckptkit.convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out.pt", dtype="bf16")
    assert report.fast
    assert report.cast == ["weight", "bias", "fp8"]
    assert "cast 2 tensors float32 -> bfloat16 (60 B -> 30 B)" in report.notes
    assert "cast 1 tensor float8_e4m3fn -> bfloat16 (2 B -> 4 B)" in report.notes
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["model"]["weight"].dtype == torch.bfloat16 and torch.equal(
        out["model"]["weight"], model.weight.detach().bfloat16()
    )
    assert torch.equal(out["model"]["fp8"], torch.ones(2, dtype=torch.bfloat16))
    for k in ("z", "n"):  # complex, int: as they were
        assert out["model"][k].dtype == state["model"][f"module.{k}"].dtype
    assert out["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32  # optimizer state is not the weights


def quantized_state() -> dict[str, torch.Tensor]:
    """A bitsandbytes 4-bit layer (uint8 weights; absmax, NF4 codebook, nested state and its packed
    quant_state beside them), a GPTQ one (packed int32 qweight, fp16 scales) and a plain norm."""
    g = torch.Generator().manual_seed(0)
    return {
        "layers.1.mlp.up_proj.weight": torch.randint(0, 255, (16, 1), generator=g, dtype=torch.uint8),
        "layers.1.mlp.up_proj.weight.absmax": torch.randint(0, 255, (1,), generator=g, dtype=torch.uint8),
        "layers.1.mlp.up_proj.weight.quant_map": torch.randn(16, generator=g),
        "layers.1.mlp.up_proj.weight.nested_absmax": torch.rand(1, generator=g),
        "layers.1.mlp.up_proj.weight.nested_quant_map": torch.randn(256, generator=g),
        "layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4": torch.arange(8, dtype=torch.uint8),
        "layers.2.self_attn.q_proj.qweight": torch.randint(0, 2**31 - 1, (1, 8), generator=g, dtype=torch.int32),
        "layers.2.self_attn.q_proj.scales": torch.rand(1, 8, generator=g).half(),  # GPTQ's, which kernels take in fp16
        "norm.weight": torch.randn(8, generator=g),
    }


# Was: --dtype bf16 cast bitsandbytes' float32 codebook and absmax, and from_pretrained then decoded
# every 4-bit layer wrong, without a word (exit 0, "cast 49 tensors").
@pytest.mark.parametrize("how", ["pt", "safetensors", "legacy"])
def test_a_quantized_weights_scales_and_codebook_are_left_as_they_are(tmp_path: Path, how: str) -> None:
    state = quantized_state()
    cast = ["norm.weight"]
    src = tmp_path / ("src.safetensors" if how == "safetensors" else "src.pt")
    if how == "safetensors":
        ckptkit.write_checkpoint(state, src)
    else:
        torch.save(state, src, _use_new_zipfile_serialization=how == "pt")
    report = ckptkit.convert_checkpoint(src, tmp_path / "out.safetensors", dtype="bf16")
    assert report.fast == (how != "legacy")
    out = ckptkit.read_checkpoint(tmp_path / "out.safetensors")
    assert report.cast == cast
    for k, v in state.items():
        if k in report.cast:
            assert torch.equal(out[k], v.to(torch.bfloat16))
        else:
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert (
        "left 4 quantization-state tensors as they are (layers.1.mlp.up_proj.weight.quant_map, ...): "
        "quantized weights decode with them"
    ) in report.notes


# Was (for one commit): the fp8 weights were widened and their block scales left beside them, so the
# output held neither fp8-quantized weights nor the model's values.
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fp8_weights_with_their_scales_are_refused_naming_both(tmp_path: Path, suffix: str) -> None:
    g = torch.Generator().manual_seed(0)
    state = {  # DeepSeek-V3's layout: each fp8 weight with its block scales' inverse beside it
        "layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "layers.0.mlp.down_proj.weight_scale_inv": torch.rand(1, 1, generator=g) + 0.1,
        "norm.weight": torch.randn(8, generator=g),
    }
    src = tmp_path / f"src{suffix}"
    torch.save(state, src) if suffix == ".pt" else ckptkit.write_checkpoint(state, src)
    with pytest.raises(
        ckptkit.errors.ArgumentError,
        match=r"^layers\.0\.mlp\.down_proj\.weight is float8_e4m3fn with layers\.0\.mlp\.down_proj\.weight_scale_inv "
        r"beside it: fp8-quantized weights",
    ):
        ckptkit.convert_checkpoint(src, tmp_path / "out.safetensors", dtype="bf16")
    assert not (tmp_path / "out.safetensors").exists()
    ckptkit.convert_checkpoint(src, tmp_path / "kept.safetensors")  # without --dtype: as they are
    got = ckptkit.read_checkpoint(tmp_path / "kept.safetensors")
    assert all(
        got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
        for k, v in state.items()
        if v.dtype == torch.float8_e4m3fn
    )


def test_the_cli_shows_the_cast_and_json_includes_it(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(4, 4), "h": torch.ones(2, dtype=torch.float64)}, tmp_path / "src.pt")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src.pt"), str(tmp_path / "a.pt"), "--dtype", "fp16"])
    assert result.exit_code == 0, result.output
    assert "note: cast 1 tensor float32 -> float16 (64 B -> 32 B)" in result.stderr
    assert "note: cast 1 tensor float64 -> float16 (16 B -> 4 B)" in result.stderr
    result = CliRunner().invoke(
        main, ["convert", str(tmp_path / "src.pt"), str(tmp_path / "b.pt"), "--dtype", "bf16", "--json"]
    )
    report = json.loads(result.stdout)
    assert report["cast"] == ["w", "h"] and any(
        n.startswith("cast 1 tensor float32 -> bfloat16") for n in report["notes"]
    )


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_damaged_source_byte_still_fails_with_no_output(tmp_path: Path, suffix: str) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(300, 300, generator=g), "b.weight": torch.randn(8, generator=g)}
    src = tmp_path / f"src{suffix}"
    torch.save(state, src) if suffix == ".pt" else ckptkit.write_checkpoint(state, src)
    flip(src, "a.weight")
    for out in ("out.pt", "out.safetensors"):
        with pytest.raises(ckptkit.errors.CheckpointFormatError, match=r"damaged: tensor a\.weight\b"):
            ckptkit.convert_checkpoint(src, tmp_path / out, dtype="bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_the_torch_path_casts_with_torch(tmp_path: Path) -> None:
    state = {
        "module.w": torch.randn(5, 3),
        "module.d": torch.randn(4, dtype=torch.float64),
        "module.i": torch.arange(2),
    }
    state["module.tied"] = state["module.w"]
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name, target in TARGETS.items():
        report = ckptkit.convert_checkpoint(tmp_path / "legacy.pt", tmp_path / f"{name}.pt", dtype=name)  # type: ignore[arg-type]
        assert not report.fast and report.cast
        out = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert torch.equal(out["w"], state["module.w"].to(target)) and out["d"].dtype == target
        assert out["tied"] is out["w"] and torch.equal(out["i"], state["module.i"])


def test_a_bad_dtype_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(ckptkit.errors.ArgumentError, match="must be one of bf16, fp16, fp32, not 'int8'"):
        ckptkit.convert_checkpoint(tmp_path / "missing.pt", tmp_path / "out.pt", dtype="int8")  # type: ignore[arg-type]
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--dtype", "int8"])
    assert result.exit_code == 2 and "Traceback" not in result.output


# Finding 1 of issue 35 on bitsandbytes' own file: --dtype bf16 cast the NF4 codebook and absmax, and
# from_pretrained then decoded every 4-bit layer wrong without a word.
def test_a_bitsandbytes_4bit_folder_cast_to_bf16_decodes_to_the_same_weights(tmp_path: Path) -> None:
    import shutil

    from tests.formats.test_producers import _framework

    nf4 = Path(__file__).resolve().parents[2] / "fixtures" / "frameworks" / "bitsandbytes" / "nf4"
    out = tmp_path / "bf16"
    report = ckptkit.convert_checkpoint(nf4, f"{out}/", dtype="bf16")
    assert any(n.startswith("left ") and "quantization-state tensors" in n for n in report.notes), report.notes
    src, got = ckptkit.read_checkpoint(nf4), ckptkit.read_checkpoint(out)
    for k, v in src.items():  # the packed weights and their state as they were; the rest cast
        assert torch.equal(got[k], v.to(torch.bfloat16) if k in report.cast else v), k
    assert report.cast and not [k for k in report.cast if k.endswith(("absmax", "quant_map")) or "quant_state" in k]
    shutil.copy(nf4 / "config.json", out)
    transformers, bnb = _framework("transformers"), _framework("bitsandbytes")
    want = transformers.LlamaForCausalLM.from_pretrained(nf4, device_map="cpu")
    have = transformers.LlamaForCausalLM.from_pretrained(out, device_map="cpu")
    layers = [(n, m) for n, m in want.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14
    for name, module in layers:
        mine = have.get_submodule(name).weight
        decoded = bnb.functional.dequantize_4bit(mine.data, mine.quant_state)
        assert torch.equal(decoded, bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)), name
