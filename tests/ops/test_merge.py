"""``convert --merge-adapter``: a LoRA adapter merged offline equals PEFT's ``merge_and_unload()``.

Every adapter here is written by peft itself (the committed ``fixtures/frameworks/peft/`` one, or
one ``get_peft_model(...).save_pretrained`` writes in the test), and every expected value is what
``PeftModel.from_pretrained(base).merge_and_unload()`` gives on this CPU: compared exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.errors import StateDictMismatchError, UnsupportedCheckpointError
from tests.cli.test_cli import run
from tests.formats.test_producers import _framework
from tests.ops.test_adapter import ADAPTER, BASE, broken, renamed


def peft_merged(base: Path, adapter: Path, dtype: torch.dtype = torch.float32, *, gpt2: bool = False) -> dict[str, Any]:
    """What PEFT gives: the base loaded by transformers, the adapter by PeftModel, merged."""
    transformers, peft = _framework("transformers"), _framework("peft")
    cls = transformers.GPT2LMHeadModel if gpt2 else transformers.LlamaForCausalLM
    model = cls.from_pretrained(base, dtype=dtype)
    return dict(peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, Any], merged: list[str]) -> None:
    assert merged and set(got) <= set(want), sorted(set(got) - set(want))
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k


def test_the_fixture_adapter_merges_as_peft_merges(tmp_path: Path) -> None:
    out = tmp_path / "merged.safetensors"
    report = ckptkit.convert_checkpoint(BASE / "model.safetensors", out, merge_adapter=ADAPTER)
    got = load_file(out)
    assert_same(got, peft_merged(BASE, ADAPTER), report.merged)
    assert len(report.merged) == 4 and report.fast, report
    assert set(got) == set(load_file(BASE / "model.safetensors"))
    changed = [k for k, v in load_file(BASE / "model.safetensors").items() if not torch.equal(v, got[k])]
    assert sorted(changed) == sorted(report.merged)  # the merge changed exactly what it says
    assert any(n.startswith(f"merged {ADAPTER} into 4 weight(s)") for n in report.notes), report.notes


def _base_copy(tmp_path: Path, dtype: torch.dtype) -> Path:
    folder = tmp_path / f"base-{dtype}".replace("torch.", "")
    folder.mkdir()
    shutil.copy(BASE / "config.json", folder)
    sd = {k: v.to(dtype) for k, v in load_file(BASE / "model.safetensors").items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_16_bit_or_float64_base_merges_in_peft_dtypes(tmp_path: Path, dtype: torch.dtype) -> None:
    # PEFT holds the adapter in float32 beside a 16-bit base and adds the float32 delta in place.
    base = _base_copy(tmp_path, dtype)
    report = ckptkit.convert_checkpoint(base, tmp_path / "merged.safetensors", merge_adapter=ADAPTER)
    assert_same(load_file(tmp_path / "merged.safetensors"), peft_merged(base, ADAPTER, dtype), report.merged)


def _tiny_llama(tmp_path: Path) -> Any:
    transformers = _framework("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(BASE)


@pytest.mark.parametrize(
    "config",
    [
        {"use_rslora": True},
        {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {r"layers\.1\.self_attn\.q_proj": 3}},
        {"r": 8, "lora_alpha": 5, "target_modules": ["q_proj", "k_proj", "gate_proj", "down_proj"]},
    ],
    ids=["rslora", "rank_and_alpha_patterns", "other_modules"],
)
def test_peft_scaling_rules_are_followed(tmp_path: Path, config: dict[str, Any]) -> None:
    peft = _framework("peft")
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False} | config
    torch.manual_seed(1)
    peft.get_peft_model(_tiny_llama(tmp_path), peft.LoraConfig(**options)).save_pretrained(tmp_path / "lora")
    report = ckptkit.convert_checkpoint(BASE, tmp_path / "merged.safetensors", merge_adapter=tmp_path / "lora")
    assert_same(load_file(tmp_path / "merged.safetensors"), peft_merged(BASE, tmp_path / "lora"), report.merged)


def test_fan_in_fan_out_gpt2_conv1d_merges_transposed(tmp_path: Path) -> None:
    transformers, peft = _framework("transformers"), _framework("peft")
    torch.manual_seed(2)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    peft.get_peft_model(base, lora).save_pretrained(tmp_path / "lora")
    report = ckptkit.convert_checkpoint(
        tmp_path / "base", tmp_path / "merged.safetensors", merge_adapter=tmp_path / "lora"
    )
    want = peft_merged(tmp_path / "base", tmp_path / "lora", gpt2=True)
    assert_same(load_file(tmp_path / "merged.safetensors"), want, report.merged)
    assert len(report.merged) == 2


@pytest.mark.parametrize("kind", ["ddp_torch_zip", "legacy_torch_path", "cast_after"])
def test_other_sources_and_paths_merge_the_same(tmp_path: Path, kind: str) -> None:
    sd = load_file(BASE / "model.safetensors")
    want = peft_merged(BASE, ADAPTER)
    options: dict[str, Any] = {}
    if kind == "legacy_torch_path":  # read by torch, merged by merge_tensors
        torch.save(sd, src := tmp_path / "base.pt", _use_new_zipfile_serialization=False)
    else:  # DDP names: matched as the single-device names PEFT sees
        torch.save({f"module.{k}": v for k, v in sd.items()}, src := tmp_path / "base.pt")
    if kind == "cast_after":
        options["dtype"] = "bf16"
        want = {k: v.to(torch.bfloat16) for k, v in want.items()}
    report = ckptkit.convert_checkpoint(src, tmp_path / "out.pt", merge_adapter=ADAPTER, **options)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(got, want, report.merged)
    assert report.fast is (kind != "legacy_torch_path"), report


def test_the_cli_merges_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "merged"
    code, stdout, err = run("convert", BASE, f"{out}/", "--merge-adapter", ADAPTER, "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert len(report["merged"]) == 4, report
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert_same(got, peft_merged(BASE, ADAPTER), report["merged"])


@pytest.mark.parametrize(
    "case",
    ["orig_mod_keys", "zero_lora_b", "rank0_slice", "no_config", "dora", "alora", "mica", "bad_rank_pattern"],
)
def test_an_adapter_that_would_not_apply_is_refused_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    edits = {
        "orig_mod_keys": renamed("base_model.model.", "base_model.model._orig_mod."),
        "zero_lora_b": lambda sd: {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in sd.items()},
        "rank0_slice": lambda sd: {k: v[: v.shape[0] // 2] if ".lora_B." in k else v for k, v in sd.items()},
    }
    adapter = broken(tmp_path, edits.get(case, lambda sd: sd))
    if case == "no_config":
        (adapter / "adapter_config.json").unlink()
    edit = {
        "dora": {"use_dora": True},
        "alora": {"alora_invocation_tokens": [1, 2]},
        "mica": {"init_lora_weights": "mica"},
        "bad_rank_pattern": {"rank_pattern": {"q_proj[": 2}},
    }
    if case in edit:
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps(config | edit[case]))
    out = tmp_path / "merged.safetensors"
    unsupported = {
        "dora": UnsupportedCheckpointError,
        "alora": UnsupportedCheckpointError,
        "mica": UnsupportedCheckpointError,
    }
    error = {"no_config": ValueError, "bad_rank_pattern": ValueError, **unsupported}.get(case, StateDictMismatchError)
    with pytest.raises(error) as e:
        ckptkit.convert_checkpoint(BASE, out, merge_adapter=adapter)
    assert not out.exists() and str(adapter) in str(e.value), e.value
    code, _, err = run("convert", BASE, out, "--merge-adapter", adapter)
    assert code != 0 and not out.exists() and "Traceback" not in err, err
    assert err.count("\n") == 1, err  # one line


# Was: fan_in_fan_out was taken from adapter_config.json; PEFT sets it by the module's type (False for
# a Linear, True for a Conv1D), so a Linear adapter saved with fan_in_fan_out=true merged transposed.
def test_fan_in_fan_out_follows_the_modules_type_not_the_config(tmp_path: Path) -> None:
    adapter = broken(tmp_path, lambda sd: sd)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"fan_in_fan_out": True}))
    report = ckptkit.convert_checkpoint(BASE, tmp_path / "merged.safetensors", merge_adapter=adapter)
    assert_same(load_file(tmp_path / "merged.safetensors"), peft_merged(BASE, adapter), report.merged)


def test_an_adapter_url_is_refused_in_one_line(tmp_path: Path) -> None:
    code, _, err = run("convert", BASE, tmp_path / "m.safetensors", "--merge-adapter", "s3://bucket/lora")
    assert code == 2 and err.startswith(
        "ckptkit: error: s3://bucket/lora: the adapter to merge is read from a local folder"
    )
