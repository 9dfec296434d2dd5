"""Checkpoints written by the training frameworks themselves (``fixtures/frameworks/``, made by
``fixtures/make_framework_fixtures.py``): inspect names the producer and where the weights and
any EMA copy are, convert writes exactly those weights, load_for_rank loads them.

Each is compared exactly with what the framework itself loads: ``torch.load(weights_only=False)``
of the file here (the fixtures are ours), and, where the framework is installed, its own loader
(``from_pretrained``, ``Accelerator.load_state``, ``timm``'s ``load_checkpoint``, ignite's
``Checkpoint.load_objects``); those tests skip, saying why, where it is not.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from fixtures.make_framework_fixtures import (
    TIMM_ARCH,
    TIMM_KWARGS,
    Registered,
    TiedNet,
    tiny_gpt2,
    torchvision_importable,
)
from tests import not_regular
from tests.cli.test_cli import run

FW = Path(__file__).resolve().parents[2] / "fixtures" / "frameworks"
NAMESPACE = ["argparse.Namespace"]  # timm train.py's args
# (fixture, producer, weights, EMA copy, what to read it with)
CASES = [
    ("trainer/checkpoint-2", "hf-trainer", "model.safetensors", None, {}),
    ("trainer_sharded/checkpoint-2", "hf-trainer", "model.safetensors.index.json", None, {}),
    ("accelerate", "accelerate", "model.safetensors", None, {}),
    ("accelerate_bin", "accelerate", "pytorch_model.bin", None, {}),
    ("timm/last.pth.tar", "timm", "state_dict", "state_dict_ema", {"allow_globals": NAMESPACE}),
    ("ignite/checkpoint_2.pt", "ignite", "model", None, {}),
    ("mmengine/epoch_1.pth", "mmengine", "state_dict", "state_dict", {"trust": True}),
    ("lightning/weight_averaging.ckpt", "lightning", "state_dict", "state_dict", {}),
    ("torch/averaged_model.pt", "averaged-model", "model", "ema_model", {}),
]
FOLDERS = {"trainer/checkpoint-2", "trainer_sharded/checkpoint-2", "accelerate", "accelerate_bin"}


def _framework(name: str) -> Any:
    """The framework module, or a skip saying why it cannot be had here."""
    torchvision_importable()  # transformers, timm and Lightning import torchvision when it is installed
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip, said as it is
        pytest.skip(
            f"{name} cannot be imported here ({type(e).__name__}: {e}); see fixtures/make_framework_fixtures.py"
        )


def _needs(name: str) -> None:
    """mmengine's message_hub pickles its HistoryBuffer class: even trusted, torch.load imports mmengine."""
    if name.startswith("mmengine"):
        _framework("mmengine.logging")


def _expected(name: str, where: str | None) -> dict[str, torch.Tensor]:
    """The weights as the framework's own file reader gives them: safetensors / torch.load of the file."""
    path = FW / name
    if name in FOLDERS:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            out: dict[str, torch.Tensor] = {}
            for shard in dict.fromkeys(json.loads(index.read_text())["weight_map"].values()):
                out.update(load_file(path / shard))
            return out
        if (path / "model.safetensors").is_file():
            return load_file(path / "model.safetensors")
        return torch.load(path / "pytorch_model.bin", weights_only=True)
    obj = torch.load(path, weights_only=False)  # our own fixtures: trusted
    return dict(obj[where]) if where else dict(obj)


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want) or set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize(("name", "producer", "weights", "ema", "opts"), CASES, ids=[c[0] for c in CASES])
def test_inspect_names_the_producer(
    name: str, producer: str, weights: str, ema: str | None, opts: dict[str, Any]
) -> None:
    _needs(name)
    s = ckptkit.inspect_checkpoint(FW / name, **opts)
    assert s.producer is not None, s
    assert (s.producer["name"], s.producer["weights"], s.producer["ema"]) == (producer, weights, ema)
    assert s.tensors and s.to_dict()["producer"] == s.producer


def test_inspect_describes_the_folders() -> None:
    trainer = ckptkit.inspect_checkpoint(FW / "trainer/checkpoint-2").producer
    assert trainer is not None and trainer["what"].startswith("Hugging Face Trainer checkpoint, step 2")
    holds = {f["name"]: f["holds"] for f in trainer["files"]}
    assert holds["optimizer.pt"].startswith("optimizer state") and holds["rng_state.pth"].startswith("RNG states")
    assert "TrainingArguments" in holds["training_args.bin"] and "TrainerState" in holds["trainer_state.json"]
    acc = ckptkit.inspect_checkpoint(FW / "accelerate").producer
    assert acc is not None and acc["what"] == "Accelerate save_state folder"
    assert any("model_1.safetensors" in n for n in acc["notes"])
    code, out, err = run("inspect", FW / "trainer/checkpoint-2")
    assert code == 0, err
    assert "Hugging Face Trainer checkpoint, step 2" in out and "rng_state.pth" in out and "Lightning?" not in out
    code, out, err = run("inspect", FW / "timm/last.pth.tar", "--allow-global", "argparse.Namespace")
    assert code == 0, err
    assert "timm CheckpointSaver checkpoint" in out and "EMA copy: state_dict_ema (--key state_dict_ema)" in out


@pytest.mark.parametrize("file", ["trainer_state.json", "config.json"])
def test_a_trainer_folder_whose_json_is_a_fifo_is_described_without_it(tmp_path: Path, file: str) -> None:
    """Its step and architecture were read with a plain open, which waits on a FIFO for a writer."""
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(FW / "trainer/checkpoint-2", folder)
    not_regular.replace(folder / file, "fifo")
    with not_regular.deadline():
        trainer = ckptkit.inspect_checkpoint(folder).producer
    assert trainer is not None and trainer["what"].startswith("Hugging Face Trainer checkpoint, step 2")


@pytest.mark.parametrize(("name", "producer", "weights", "ema", "opts"), CASES, ids=[c[0] for c in CASES])
def test_convert_takes_the_weights(
    tmp_path: Path, name: str, producer: str, weights: str, ema: str | None, opts: dict[str, Any]
) -> None:
    _needs(name)
    out = tmp_path / "model.safetensors"
    report = ckptkit.convert_checkpoint(FW / name, out, model_only=True, **opts)
    want = _expected(name, None if name in FOLDERS else weights)
    got = ckptkit.read_checkpoint(out)  # tied weights stored once are re-tied, as load_model does
    if producer == "hf-trainer":  # tied lm_head.weight is stored once, as the source stores it
        assert "lm_head.weight" not in got
    _same(got, want)
    assert report.weights_at == ("" if name in FOLDERS else weights)
    assert ckptkit.diff_checkpoints(FW / name, out, **opts).equal if not opts.get("allow_globals") else True


def test_convert_takes_an_ema_copy_by_key(tmp_path: Path) -> None:
    code, _, err = run(
        "convert",
        FW / "timm/last.pth.tar",
        tmp_path / "ema.safetensors",
        "--key",
        "state_dict_ema",
        "--model-only",
        "--allow-global",
        "argparse.Namespace",
    )
    assert code == 0, err
    _same(load_file(tmp_path / "ema.safetensors"), _expected("timm/last.pth.tar", "state_dict_ema"))
    ckptkit.convert_checkpoint(
        FW / "torch/averaged_model.pt", tmp_path / "avg.safetensors", key="ema_model", model_only=True
    )
    want = {
        k.removeprefix("module."): v
        for k, v in _expected("torch/averaged_model.pt", "ema_model").items()
        if k != "n_averaged"
    }
    _same(ckptkit.read_checkpoint(tmp_path / "avg.safetensors"), want)


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_verify_and_load_the_folders(name: str) -> None:
    report = ckptkit.verify_checkpoint(FW / name)
    assert report.ok, [c for c in report.checks if not c.ok]
    if name.startswith("accelerate"):
        model = TiedNet()
        ckptkit.load_for_rank(FW / name, model=model)
        assert model.head.weight is model.embed.weight  # the tie held: loaded through the embedding
        _same(model.state_dict(), {**_expected(name, None), "head.weight": _expected(name, None)["embed.weight"]})


def test_trainer_folder_loads_like_from_pretrained() -> None:
    transformers = _framework("transformers")
    for name in ("trainer/checkpoint-2", "trainer_sharded/checkpoint-2"):
        theirs = transformers.GPT2LMHeadModel.from_pretrained(FW / name)
        ours = tiny_gpt2()
        ckptkit.load_for_rank(FW / name, model=ours)  # lm_head.weight is not stored: filled from its tie
        assert ours.lm_head.weight is ours.transformer.wte.weight
        _same(ours.state_dict(), theirs.state_dict())


def test_accelerate_folder_loads_like_load_state() -> None:
    accelerate = _framework("accelerate")
    for name in ("accelerate", "accelerate_bin"):
        acc = accelerate.Accelerator(cpu=True)
        model, second = acc.prepare(TiedNet(), torch.nn.Linear(8, 2))
        acc.register_for_checkpointing(Registered())  # load_state wants as many as were saved
        acc.load_state(str(FW / name))
        ours = TiedNet()
        ckptkit.load_for_rank(FW / name, model=ours)
        _same(ours.state_dict(), model.state_dict())
        other = torch.nn.Linear(8, 2)
        ckptkit.load_for_rank(
            FW / name / ("model_1.safetensors" if name == "accelerate" else "pytorch_model_1.bin"), model=other
        )
        _same(other.state_dict(), second.state_dict())


@pytest.mark.parametrize("use_ema", [False, True])
def test_timm_loads_like_timm(use_ema: bool) -> None:
    timm = _framework("timm")
    theirs = timm.create_model(TIMM_ARCH, **TIMM_KWARGS)
    timm.models.load_checkpoint(theirs, str(FW / "timm/last.pth.tar"), use_ema=use_ema, weights_only=False)
    ours = timm.create_model(TIMM_ARCH, **TIMM_KWARGS)
    key = "state_dict_ema" if use_ema else None
    ckptkit.load_for_rank(FW / "timm/last.pth.tar", model=ours, key=key, allow_globals=NAMESPACE)
    _same(ours.state_dict(), theirs.state_dict())


def test_ignite_loads_like_ignite() -> None:
    handlers = _framework("ignite.handlers")
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    handlers.Checkpoint.load_objects({"model": theirs}, torch.load(FW / "ignite/checkpoint_2.pt", weights_only=False))
    ckptkit.load_for_rank(FW / "ignite/checkpoint_2.pt", model=net)
    _same(net.state_dict(), theirs.state_dict())


# -- torchtitan: the model's weights flattened at the top level ----------------------------------

TITAN = FW / "torchtitan" / "step-2"  # written by torchtitan's CheckpointManager


def _titan_weights() -> dict[str, torch.Tensor]:
    """What torchtitan's model-only load gives: DCP's own load of the model's flattened names."""
    import torch.distributed.checkpoint as dcp

    from fixtures.make_framework_fixtures import TitanLM
    from tests.torchcompat import LOAD_ALONE

    state = {k: torch.empty_like(v) for k, v in TitanLM().state_dict().items()}
    dcp.load(state, checkpoint_id=str(TITAN), **LOAD_ALONE)
    return state


# Was: ckptkit took train_state ({"step": tensor}) for the model: 1 tensor, exit 0; or, in a file
# without one, "no model state dict found", with no --key for the top level.
@pytest.mark.parametrize("form", ["dcp", "file"])
def test_a_torchtitan_checkpoint_is_read_as_its_flattened_model_weights(tmp_path: Path, form: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fixtures.make_framework_fixtures import TitanLM

    src = TITAN
    if form == "file":  # torch's own conversion of the folder: the same layout in one file
        src = tmp_path / "titan.pt"
        dcp_to_torch_save(TITAN, src)
    want = _titan_weights()
    s = ckptkit.inspect_checkpoint(src)
    assert s.producer is not None and (s.producer["name"], s.weights_at) == ("torchtitan", ".")
    assert [e["name"] for e in s.entries] == ["train_state", "optimizer", "dataloader", "lr_scheduler"]
    model = TitanLM()
    ckptkit.load_for_rank(src, model=model)
    _same(model.state_dict(), want)
    report = ckptkit.convert_checkpoint(src, tmp_path / "model.safetensors", model_only=True)
    assert report.weights_at == "." and report.dropped == ["train_state", "optimizer", "dataloader", "lr_scheduler"]
    _same(load_file(tmp_path / "model.safetensors"), want)
    ckptkit.convert_checkpoint(src, tmp_path / "all.pt")  # the rest kept, in its place
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert list(whole)[:4] == ["train_state", "optimizer", "dataloader", "lr_scheduler"]
    _same({k: whole[k] for k in want}, want)
    assert int(whole["train_state"]["step"]) == 2


def test_key_dot_selects_the_tensors_among_the_top_levels_entries(tmp_path: Path) -> None:
    weights = {"weight": torch.ones(2, 1), "bias": torch.zeros(2)}
    torch.save({**weights, "epoch": 3, "opt": {"lr": 0.1}}, tmp_path / "ckpt.pt")
    with pytest.raises(ckptkit.errors.LayoutError, match="no model state dict found"):
        ckptkit.load_for_rank(tmp_path / "ckpt.pt", model=torch.nn.Linear(1, 2))  # no module path: not taken unasked
    model = torch.nn.Linear(1, 2)
    ckptkit.load_for_rank(tmp_path / "ckpt.pt", model=model, key=".")
    _same(model.state_dict(), weights)
    code, out, err = run("convert", tmp_path / "ckpt.pt", tmp_path / "w.safetensors", "--key", ".", "--model-only")
    assert code == 0 and "(weights at the top level, beside its other entries)" in out, err
    _same(load_file(tmp_path / "w.safetensors"), weights)


# -- PEFT adapters ---------------------------------------------------------------------------------

ADAPTER = FW / "peft" / "adapter"  # written by PeftModel.save_pretrained (LoRA r=4 on q_proj, v_proj)


# Was: an adapter was named as nothing, its folder was refused ("give a file"), and diff had no
# --strip to compare it with its names stripped.
def test_a_peft_adapter_is_named_read_whole_and_diffed_with_strip(tmp_path: Path) -> None:
    want = load_file(ADAPTER / "adapter_model.safetensors")
    for src in (ADAPTER, ADAPTER / "adapter_model.safetensors"):
        s = ckptkit.inspect_checkpoint(src)
        assert s.producer is not None and s.producer["name"] == "peft", s.producer
        assert s.producer["what"] == "PEFT LoRA adapter (rank 4 on q_proj, v_proj, 4 modules)"
        report = ckptkit.convert_checkpoint(src, tmp_path / "same.safetensors", force=True)
        assert report.renamed == 0  # PEFT's names are what PEFT loads: kept
        _same(load_file(tmp_path / "same.safetensors"), want)
    code, out, err = run("convert", ADAPTER, tmp_path / "plain.safetensors", "--strip", "base_model.model.")
    assert code == 0, err
    assert run("diff", ADAPTER, tmp_path / "plain.safetensors")[0] == 1  # no shared names
    code, out, err = run("diff", ADAPTER, tmp_path / "plain.safetensors", "--strip", "base_model.model.")
    assert code == 0 and "same weights: 8 tensors compared" in out, (out, err)


def test_a_peft_adapter_reads_like_peft() -> None:
    peft_utils = _framework("peft.utils")
    _same(ckptkit.load_for_rank(ADAPTER), peft_utils.load_peft_weights(str(ADAPTER)))


TITAN_TO_HF = [  # the renames of torchtitan's Llama to Hugging Face's (as its convert_to_hf does)
    r"^tok_embeddings\.=model.embed_tokens.",
    r"^layers\.(\d+)\.attention\.wq\.=model.layers.\1.self_attn.q_proj.",
    r"^layers\.(\d+)\.feed_forward\.w1\.=model.layers.\1.mlp.gate_proj.",
    r"^output\.=lm_head.",
]


def test_rename_rules_give_torchtitans_weights_hugging_faces_names(tmp_path: Path) -> None:
    rules = tmp_path / "titan_to_hf.txt"
    rules.write_text("# torchtitan -> Hugging Face\n" + "\n".join(TITAN_TO_HF) + "\n\n")
    out = tmp_path / "hf.safetensors"
    code, _, err = run(
        "convert", TITAN, out, "--model-only", "--rename-file", rules, "--rename", r"^norm\.=model.norm."
    )
    assert code == 0, err
    want = _titan_weights()
    got = load_file(out)
    assert list(got) == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    for (k, v), w in zip(got.items(), want.values(), strict=True):
        assert torch.equal(v, w), k
    code, _, err = run("convert", TITAN, tmp_path / "x.safetensors", "--model-only", "--rename", r"^nothing\.=x.")
    assert code == 0 and r"note: rename rule '^nothing\.=x.' matched no weight's name" in err, err


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        (
            r"^.*\.weight$=w",
            "rename rules give 'tok_embeddings.weight' and 'layers.0.attention.wq.weight' the same name 'w'",
        ),
        ("(=x", "rename rule '(=x': '(' is not a regular expression"),
        (r"^(layers)=\2", r"rename rule '^(layers)=\2': invalid group reference 2"),
        ("no-equals-sign", "rename rule 'no-equals-sign' is not REGEX=REPL"),
    ],
)
def test_a_rename_rule_that_cannot_work_is_one_usage_line(tmp_path: Path, rule: str, said: str) -> None:
    code, _, err = run("convert", TITAN, tmp_path / "x.safetensors", "--model-only", "--rename", rule)
    assert code == 2 and err.startswith(f"ckptkit: error: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.safetensors").exists()
