"""``ckptkit check-adapter``: a PEFT LoRA adapter checked against its base as PEFT will load it.

The good adapter and its base are written by peft and transformers themselves
(``fixtures/frameworks/peft/``); each broken one is that adapter as the public threads' bugs left
it: torch.compile's ``_orig_mod.`` in its keys, PEFT's ``base_model.model.`` missing, one rank's
slice (FSDP2 shards dim 0), every ``lora_B`` still zero, a targeted module left out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptkit
from tests.cli.test_cli import run

PEFT = Path(__file__).resolve().parents[2] / "fixtures" / "frameworks" / "peft"
ADAPTER, BASE = PEFT / "adapter", PEFT / "base"
Edit = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def broken(tmp_path: Path, edit: Edit) -> Path:
    """The good adapter, edited, in a folder of its own with its adapter_config.json."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    shutil.copy(ADAPTER / "adapter_config.json", folder)
    save_file(edit(load_file(ADAPTER / "adapter_model.safetensors")), folder / "adapter_model.safetensors")
    return folder


def renamed(old: str, new: str) -> Edit:
    return lambda sd: {k.replace(old, new, 1): v for k, v in sd.items()}


def test_a_good_adapter_applies() -> None:
    report = ckptkit.check_adapter(ADAPTER, BASE)
    assert report.ok and report.modules == 4 and not report.notes, report
    code, out, err = run("check-adapter", ADAPTER, BASE)
    assert code == 0 and out.startswith("applies: 4 modules"), (out, err)


@pytest.mark.parametrize(
    ("edit", "flags"),
    [
        (renamed("base_model.model.", "base_model.model._orig_mod."), ""),  # PeftModel over torch.compile (Soup#335)
        (renamed("base_model.model.", ""), " --add base_model.model."),  # PEFT's prefix lost
        (renamed("base_model.model.", "module.base_model.model."), ""),  # saved through DDP's wrapper
    ],
    ids=["orig_mod", "no_peft_prefix", "ddp_module"],
)
def test_keys_peft_would_not_match_are_named_and_the_fix_is_checked(tmp_path: Path, edit: Edit, flags: str) -> None:
    adapter = broken(tmp_path, edit)
    report = ckptkit.check_adapter(adapter, BASE)
    assert not report.ok and len(report.unmatched) == 8 and report.modules == 0
    assert report.fix.endswith(flags) and ("--add" in report.fix) == bool(flags), report.fix
    assert f"ckptkit convert {adapter} " in report.fix
    code, out, err = run("check-adapter", adapter, BASE, "--json")
    assert code == 1 and json.loads(out)["unmatched"] == report.unmatched
    # The fix, followed as printed: the new adapter applies, and holds the good adapter's tensors.
    fix = report.fix.replace("ckptkit convert", f"{sys.executable} -m ckptkit.cli convert")
    subprocess.run(["bash", "-euo", "pipefail", "-c", fix], check=True, capture_output=True)
    fixed = Path(f"{adapter}-fixed")
    assert ckptkit.check_adapter(fixed, BASE).ok
    want, got = load_file(ADAPTER / "adapter_model.safetensors"), load_file(fixed / "adapter_model.safetensors")
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_one_ranks_slice_shows_as_shapes_that_do_not_fit(tmp_path: Path) -> None:
    # FSDP2 shards dim 0: rank 0 saved the first half of each lora_A's rank and of each lora_B's rows.
    adapter = broken(tmp_path, lambda sd: {k: v[: v.shape[0] // 2].clone() for k, v in sd.items()})
    report = ckptkit.check_adapter(adapter, BASE)
    assert not report.ok and not report.unmatched
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert f"{b}: [4, 4], but its base module has out_features 8 (base weight [8, 8])" in report.shapes
    assert f"{b}: rank 4, but its lora_A has rank 2" in report.shapes
    assert any("rank 2, but adapter_config.json says r=4" in s for s in report.shapes)


def test_an_adapter_whose_every_lora_b_is_zero_changes_nothing(tmp_path: Path) -> None:
    adapter = broken(tmp_path, lambda sd: {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in sd.items()})
    report = ckptkit.check_adapter(adapter, BASE)
    assert not report.ok and len(report.zero_b) == 4 and "changes nothing" in report.notes[0]
    assert run("check-adapter", adapter, BASE)[0] == 1


def test_a_targeted_module_without_an_adapter_is_named(tmp_path: Path) -> None:
    adapter = broken(tmp_path, lambda sd: {k: v for k, v in sd.items() if "layers.1.self_attn.v_proj" not in k})
    report = ckptkit.check_adapter(adapter, BASE)
    assert report.untargeted == ["model.layers.1.self_attn.v_proj"] and report.modules == 3


def test_a_file_without_lora_tensors_is_refused_in_one_line() -> None:
    code, out, err = run("check-adapter", BASE, BASE)
    assert code == 2 and err.count("\n") == 1 and "not a PEFT LoRA adapter" in err, err


def test_ranks_set_per_module_by_rank_pattern_are_not_flagged(tmp_path: Path) -> None:
    # PEFT gives v_proj rank 2 from rank_pattern; the check read only r=4 and called it a misfit.
    from tests.formats.test_producers import _framework

    transformers, peft = _framework("transformers"), _framework("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})
    peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(BASE), config).save_pretrained(tmp_path / "lora")
    report = ckptkit.check_adapter(tmp_path / "lora", BASE)
    assert not report.shapes and report.modules == 4, report
